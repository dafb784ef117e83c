"""Recipe for decoder-only transformers whose every layer is causal attention
(Llama, SmolLM2, Qwen3 dense, Mistral, Qwen2).

The canonical Transformers model is instantiated on the meta device; its
parameters and constant buffers are then re-bound to views of the prepared
arena, so the module tree (names, config, forward) stays Transformers' own.
Only the attention function is replaced (``flare_paged``), and the model is
called on packed tokens with explicit positions. Every layer attends, so layer
``i`` owns KV layer ``i``, and the model carries no continuation state beyond
the final hidden vector.

Tensor parallelism (``SHARDING``, docs/tensor-parallel.md): with a TP size N > 1
each rank's weights are its slice of the declared dimension (heads, MLP
intermediates, vocabulary), everything else is replicated; row-parallel layers
all-reduce their output, the embedding looks up only its own vocabulary rows and
all-reduces, and ``lm_head`` all-gathers the logits before the sampler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from flare.prepare import attention as _attention  # registers flare_paged
from flare.prepare.attention import PagedBatch
from flare.prepare.parallel import SINGLE, Shard, ShardingError, TensorParallel
from flare.prepare.recipes.fused import fuse_projections, parts_of

# Tensor-parallel partition of the decoder family, by owning module (path suffix):
# the sharded dimension of its weight. Column-parallel layers (dim 0 of a Linear)
# keep whole heads / intermediate rows and need nothing after them; row-parallel
# layers (dim 1) produce partial sums that are all-reduced; the embedding (dim 0,
# vocabulary rows) is a masked lookup plus all-reduce, and lm_head (the same rows,
# tied or not) is all-gathered. Everything not listed is replicated.
SHARDING = {
    "self_attn.q_proj": 0,
    "self_attn.k_proj": 0,
    "self_attn.v_proj": 0,
    "self_attn.o_proj": 1,
    "mlp.gate_proj": 0,
    "mlp.up_proj": 0,
    "mlp.down_proj": 1,
    "embed_tokens": 0,
    "lm_head": 0,
}
ROW_PARALLEL = tuple(k for k, d in SHARDING.items() if d == 1 and k not in ("embed_tokens", "lm_head"))
# Config dimensions the TP size must divide for the partition above to be even.
DIVIDED_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class WeightPart:
    """One checkpoint tensor held in a fused buffer's rows (recipes/fused.py)."""

    name: str  # checkpoint tensor name
    rows: int  # this rank's rows of it in the buffer
    shard: Shard | None  # this rank's slice of the checkpoint tensor; None: replicated


@dataclass(frozen=True)
class WeightSpec:
    buffer: str  # arena buffer name
    names: tuple[str, ...]  # module paths bound to this storage (ties share one buffer)
    shape: tuple[int, ...]
    dtype: torch.dtype
    from_checkpoint: bool  # False for constants computed at preparation (rotary tables)
    shard: Shard | None = None  # this rank's slice of the checkpoint tensor; None: replicated
    parts: tuple[WeightPart, ...] = ()  # a fused buffer: the checkpoint tensors in its rows, in order

    def destinations(self, view: torch.Tensor) -> list[tuple[str, torch.Tensor, Shard | None]]:
        """(checkpoint tensor name, its rows of ``view``, this rank's shard of it) for every
        checkpoint tensor the buffer holds; a tied buffer is loaded once, by its first name."""
        if not self.parts:
            return [(self.names[0], view, self.shard)]
        out, row = [], 0
        for p in self.parts:
            out.append((p.name, view[row : row + p.rows], p.shard))
            row += p.rows
        return out

    def checkpoint_views(self, view: torch.Tensor) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> its tensor in ``view`` (every name of a tie)."""
        if not self.parts:
            return {n: view for n in self.names}
        return {name: t for name, t, _ in self.destinations(view)}


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int


class DecoderRecipe:
    name = "decoder"
    model_types = ("llama", "qwen3", "qwen2", "mistral")

    def build(self, config, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> nn.Module:
        """The canonical model on the meta device, attention replaced; with TP the
        collectives of ``SHARDING`` are attached (the weights are bound later)."""
        from transformers import AutoModelForCausalLM

        if tp.active:
            self.check_divisible(config, tp.size)
        config._attn_implementation = _attention.ATTENTION_NAME
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config._attn_implementation = _attention.ATTENTION_NAME
        model.eval()
        model.requires_grad_(False)
        for i, layer in enumerate(self.decoder_layers(model)):
            layer.self_attn.kv_layer = i
        # One GEMM for q/k/v and one for gate/up (recipes/fused.py), on every path.
        fuse_projections(self.decoder_layers(model))
        model.flare_tp = tp
        if tp.active:
            _attach_collectives(model, tp)
        return model

    def check_divisible(self, config, tp_size: int) -> None:
        cfg = config.get_text_config()
        for dim in DIVIDED_DIMS:
            n = getattr(cfg, dim)
            if n % tp_size:
                raise ShardingError(f"--tp {tp_size} does not divide {dim} ({n}): the {self.name} recipe "
                                    f"shards it evenly over ranks")

    def parallel(self, model: nn.Module) -> TensorParallel:
        return model.flare_tp

    def weights(self, model: nn.Module) -> list[WeightSpec]:
        tp = self.parallel(model)
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
        specs = []
        for k, names in groups.items():
            full = tuple(tensors[k].shape)
            fused = parts_of(model, names[0])
            if fused:
                parts = tuple(_fused_part(name, rows, tp) for name, rows in fused)
                specs.append(WeightSpec("w." + names[0], tuple(names), (sum(p.rows for p in parts), *full[1:]),
                                        tensors[k].dtype, True, None, parts))
                continue
            shard = _shard_of(names, tp)
            specs.append(WeightSpec("w." + names[0], tuple(names), shard.shape(full) if shard else full,
                                    tensors[k].dtype, True, shard))
        for name, b in model.named_buffers():
            specs.append(WeightSpec("c." + name, (name,), tuple(b.shape), b.dtype, False))
        return specs

    def checkpoint_state(self, config_json: str, image: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A core's image tensors (arena buffer name -> tensor) as a Transformers state dict
        of the canonical model: fused buffers split back into their checkpoint tensors,
        tied names sharing one tensor, computed constants left out. For baselines and
        comparisons that load the core's weights into Transformers' own model."""
        model = self.build(self.config_from_json(config_json), torch.float32)
        state = {}
        for spec in self.weights(model):
            if spec.from_checkpoint:
                state.update(spec.checkpoint_views(image[spec.buffer]))
        return state

    def bind(self, model: nn.Module, specs: list[WeightSpec], views: dict[str, torch.Tensor]) -> None:
        """Point every parameter and constant buffer at its arena view."""
        for spec in specs:
            view = views[spec.buffer]
            for path in spec.names:
                owner_path, _, attr = path.rpartition(".")
                owner = model.get_submodule(owner_path)
                if spec.from_checkpoint:
                    owner._parameters[attr] = nn.Parameter(view, requires_grad=False)
                else:
                    owner._buffers[attr] = view

    def compute_constants(self, model: nn.Module, specs: list[WeightSpec], views: dict[str, torch.Tensor]) -> None:
        """Constant buffers (rotary frequency tables) are rebuilt on the CPU from the
        owning module's config and copied into the arena."""
        for spec in specs:
            if spec.from_checkpoint:
                continue
            path = spec.names[0]
            owner_path, _, attr = path.rpartition(".")
            owner = model.get_submodule(owner_path)
            with torch.device("cpu"):
                twin = type(owner)(owner.config)
            views[spec.buffer].copy_(getattr(twin, attr))

    def kv_geometry(self, config, tp_size: int = 1) -> KVGeometry:
        """One rank's KV geometry: its kv_heads / tp_size heads."""
        config = config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVGeometry(config.num_hidden_layers, config.num_key_value_heads // tp_size, head_dim)

    def hidden_size(self, config) -> int:
        return config.get_text_config().hidden_size

    def vocab_size(self, config) -> int:
        return config.get_text_config().vocab_size

    def state_buffers(self, config, dtype) -> list[tuple[str, object, tuple[int, ...]]]:
        """Per-slot continuation state besides the hidden vector: (buffer name, DType,
        row shape). Attention-only models carry none."""
        return []

    def forward_tokens(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, batch: PagedBatch):
        """Final-normed hidden states ``[T, H]`` for packed tokens."""
        out = model.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, paged=batch)
        return out.last_hidden_state[0]

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def lm_head(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (gathered from the vocabulary shards)."""
        return self.parallel(model).all_gather(model.lm_head(hidden), dim=-1)

    def config_json(self, config) -> str:
        d = config.to_dict()
        d.pop("_attn_implementation", None)
        d.pop("_attn_implementation_internal", None)
        return json.dumps(d, sort_keys=True)

    def config_from_json(self, text: str):
        from transformers import AutoConfig

        d = json.loads(text)
        model_type = d.pop("model_type")
        return AutoConfig.for_model(model_type, **d)


def _fused_part(name: str, rows: int, tp: TensorParallel) -> WeightPart:
    """A fused buffer concatenates rows, so each part must be sharded by rows (or not at
    all): rank r's buffer is then [part0_r; part1_r; ...]."""
    shard = _shard_of((name,), tp)
    if shard is not None and shard.dim != 0:
        raise ShardingError(f"{name} is fused by rows but declared sharded along dim {shard.dim}")
    return WeightPart(name, rows // tp.size if shard else rows, shard)


def _shard_of(names: tuple[str, ...] | list[str], tp: TensorParallel) -> Shard | None:
    """The declared partition of a parameter (tied parameters share theirs)."""
    if not tp.active:
        return None
    dims = set()
    for name in names:
        owner, _, attr = name.rpartition(".")
        dim = next((d for suffix, d in SHARDING.items() if owner == suffix or owner.endswith("." + suffix)), None)
        if dim is not None and attr == "bias":
            if dim == 1:
                raise ShardingError(f"{name}: a row-parallel layer with a bias would add it on every rank")
            dim = 0
        dims.add(dim)
    if len(dims) != 1:
        raise ShardingError(f"tied parameters {list(names)} are declared with different partitions {dims}")
    dim = dims.pop()
    return None if dim is None else Shard(dim, tp.rank, tp.size)


class VocabParallelEmbedding(nn.Module):
    """The embedding of a vocabulary-sharded rank: ids outside this rank's rows look up
    zeros, and the all-reduce assembles every id's row from its owning rank."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallel):
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


def _attach_collectives(model: nn.Module, tp: TensorParallel) -> None:
    model.set_input_embeddings(VocabParallelEmbedding(model.get_input_embeddings().weight, tp))
    for name, module in model.named_modules():
        if any(name.endswith("." + suffix) for suffix in ROW_PARALLEL):
            module.register_forward_hook(lambda _m, _args, out: tp.all_reduce(out))
