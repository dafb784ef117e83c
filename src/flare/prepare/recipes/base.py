"""The recipe base: what a model family declares, and the machinery every family shares.

A recipe turns a Transformers architecture into the model the prepared programs
call. The canonical Transformers model is instantiated on the meta device, so
its module tree (names, config, forward) stays Transformers' own; then:

1. **replacements** — modules that cannot be captured as written (a recurrence
   that keeps its state in a Transformers cache, an expert loop that picks
   experts on the host) get a prepared subclass (``Replacement``). Each instance
   learns its index among the modules of its kind (``state_index``); the
   per-slot state the replacements keep is declared to the manifest
   (``state_buffers``) as continuation state, which the runtime snapshots and
   restores without knowing what it is;
2. **attention** — every decoder layer's ``self_attn`` calls the shared paged
   attention (``flare_paged``) and owns the next KV layer (``kv_layer``);
3. **fusion** — q/k/v and gate/up projections of known classes become one GEMM
   each (``recipes/fused.py``);
4. **the layer check** — every direct child of a decoder layer must now be fused,
   replaced, or declared ``eager`` (run as Transformers wrote it): a class the
   recipe did not think about is an error, never a silent slow path;
5. **tensor parallelism** — the ``sharding`` table (data the recipe owns) names the
   sharded dimension of each owning module; row-parallel outputs are all-reduced,
   the vocabulary-sharded embedding is a masked lookup plus all-reduce, and the
   head all-gathers its logits.

Parameters and constant buffers are then re-bound to views of the prepared
arena (``weights`` / ``bind``). Preparation calls, in order: ``build``,
``weights``, ``bind``, (weights load), ``compute_constants``; the programs call
``forward_tokens`` and ``lm_head``. Geometry for the memory plan comes from the
config alone: ``kv_geometry``, ``state_buffers``, ``hidden_size``, ``vocab_size``.

Adding a family: docs/adding-a-model.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from flare.core.manifest import DType
from flare.prepare import attention as _attention  # registers flare_paged
from flare.prepare.attention import PagedBatch
from flare.prepare.parallel import SINGLE, Shard, ShardingError, TensorParallel
from flare.prepare.recipes import mtp as _mtp
from flare.prepare.recipes.fused import fuse_projections, is_fused, parts_of


class RecipeError(ValueError):
    """A model the recipe cannot prepare as declared (an undeclared layer class)."""


@dataclass(frozen=True)
class StateBuffer:
    """Per-slot continuation state of a prepared module kind: one row per request slot."""

    name: str  # "state.<...>"; its snapshot twin is named by the contract's rule
    dtype: DType
    row: tuple[int, ...]  # shape of one slot's row
    # Written by prefill programs only; decode and verify steps leave it (no verify twin).
    prefill_only: bool = False


@dataclass(frozen=True)
class Replacement:
    """A Transformers module class replaced by a prepared subclass.

    ``prepared`` receives the Transformers class and returns the subclass whose
    forward reads the ``paged`` batch (``PagedBatch``: positions, validity, and the
    slot state rows in ``paged.state``); it is called once per class, so every
    instance shares one class (torch.compile guards on a module's type). Each
    instance gets ``state_index``: its position among the modules of this kind, the
    index into the kind's state buffers. ``state`` declares those buffers from the
    config and the TP size (each row covering every module of the kind, a rank's share of
    its heads). ``setup`` runs on every
    instance once its class is replaced (for example to fuse its projections with
    ``fused.fuse_linears``: checkpoint names stay those of the original modules)."""

    original: str  # the Transformers class name
    prepared: Callable[[type], type]
    state: Callable[[Any, DType, int], Sequence[StateBuffer]] = lambda config, dtype, tp_size: ()
    setup: Callable[[nn.Module], None] = lambda module: None


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


@dataclass
class PreparedModel:
    """The recipe's model: the Transformers module tree (modules replaced and fused,
    parameters on the meta device until bound) and the rank it was built for."""

    module: nn.Module
    tp: TensorParallel
    # Prepared modules whose forward Transformers calls without the batch (a class with
    # ``reads_batch``): forward_tokens hands it to them as ``flare_paged``.
    batch_readers: tuple[nn.Module, ...] = ()


_PREPARED: dict[tuple[int, type], type] = {}


class Recipe:
    """The base of every recipe. A family sets the class attributes below and overrides
    the geometry methods its config needs; see the module docstring for the order."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    # Module path suffix -> the dimension of its weight that tensor parallelism shards
    # (0: output rows, column-parallel; 1: input columns, row-parallel, output all-reduced;
    # ``embed_tokens`` / ``lm_head``: vocabulary rows). Unlisted weights are replicated.
    # Empty: the recipe supports no tensor parallelism.
    sharding: Mapping[str, int] = {}
    # Module path suffix -> the sizes, from the text config, of the consecutive blocks of its
    # sharded dimension that are each split over the ranks (a projection whose rows are
    # q | k | v of different head counts); unlisted: the dimension is one block.
    shard_blocks: Mapping[str, Callable[[Any], tuple[int, ...]]] = {}
    divided_dims: tuple[str, ...] = ()  # config dimensions the TP size must divide
    # Classes of decoder-layer children that run as Transformers wrote them (norms, and
    # mixers that are neither fused nor replaced).
    eager: frozenset[str] = frozenset()
    replacements: tuple[Replacement, ...] = ()
    # The family's checkpoints may carry a multi-token-prediction head (recipes/mtp.py) that
    # this recipe builds when the config declares it (flare-prepare --mtp keeps the declaration).
    mtp: bool = False
    # Rows of position ids the model's rotary table takes (multimodal RoPE sections; 0: the
    # plain [batch, tokens] ids).
    rotary_sections: int = 0

    # -- geometry (from the config alone) -----------------------------------------

    def kv_geometry(self, config, tp_size: int = 1) -> KVGeometry:
        """One rank's KV geometry: every layer attends, kv_heads / tp_size heads each."""
        config = config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVGeometry(config.num_hidden_layers, config.num_key_value_heads // tp_size, head_dim)

    def sliding_window(self, config) -> int | None:
        """The smallest attention window any layer declares (None: every layer attends to
        its whole history), reported by preparation; the attention itself takes each
        layer's window from Transformers' call (``attention.flare_paged_attention``).
        Transformers marks windowed layers in ``layer_types`` ("sliding_attention"); a
        config with a ``sliding_window`` and no ``layer_types`` (Mistral) windows every layer."""
        t = config.get_text_config()
        window = getattr(t, "sliding_window", None)
        kinds = getattr(t, "layer_types", None)
        if not window or (kinds is not None and "sliding_attention" not in kinds):
            return None
        return int(window)

    def hidden_size(self, config) -> int:
        return config.get_text_config().hidden_size

    def mtp_layers(self, config) -> int:
        """MTP layers the recipe builds for this config (each owns one more KV layer)."""
        return _mtp.declared_layers(config) if self.mtp else 0

    def vocab_size(self, config) -> int:
        return config.get_text_config().vocab_size

    def state_buffers(self, config, dtype: DType, tp_size: int = 1) -> list[StateBuffer]:
        """Per-slot continuation state besides the hidden vector: every replacement's (one
        rank's, which holds ``1 / tp_size`` of each module's heads)."""
        return [b for r in self.replacements for b in r.state(config, dtype, tp_size)]

    # -- build -----------------------------------------------------------------------

    def build(self, config, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> PreparedModel:
        """The canonical model on the meta device, prepared as the module docstring says
        (the weights are bound later)."""
        from transformers import AutoModelForCausalLM

        if tp.active:
            self.check_divisible(config, tp.size)
        config._attn_implementation = _attention.ATTENTION_NAME
        text = config.get_text_config()
        text._attn_implementation = _attention.ATTENTION_NAME
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config._attn_implementation = _attention.ATTENTION_NAME
        if self.mtp_layers(config):
            if tp.active:
                raise ShardingError("an MTP head (--mtp) is not supported with tensor parallelism yet")
            try:
                with torch.device("meta"):
                    _mtp.attach(model, config, dtype)
            except ValueError as e:
                raise RecipeError(str(e)) from None
        model.eval()
        model.requires_grad_(False)
        self._replace(model)
        layers = self.decoder_layers(model)
        kv_layer = 0
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn.kv_layer = kv_layer
                kv_layer += 1
        fuse_projections(layers)
        self._check_layers(layers)
        if tp.active:
            self.shard_modules(model, tp)
            _attach_collectives(model, tp, self.sharding)
        readers = tuple(m for m in model.modules() if getattr(type(m), "reads_batch", False))
        for m in readers:  # prepared modules that run their own collectives read the rank here
            m.flare_tp = tp
        return PreparedModel(model, tp, readers)

    def shard_modules(self, model: nn.Module, tp: TensorParallel) -> None:
        """With tensor parallelism: give prepared modules that keep head counts of their own
        (a Gated DeltaNet's) one rank's share of them (the weights are sliced by ``sharding``)."""

    def check_divisible(self, config, tp_size: int) -> None:
        if not self.sharding:
            raise ShardingError(f"the {self.name} recipe declares no tensor-parallel sharding yet (--tp {tp_size})")
        cfg = config.get_text_config()
        for dim in self.divided_dims:
            n = getattr(cfg, dim)
            if n % tp_size:
                raise ShardingError(f"--tp {tp_size} does not divide {dim} ({n}): the {self.name} recipe "
                                    f"shards it evenly over ranks")

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """The model's decoder layers, then its MTP head's (they own the last KV layers)."""
        head = getattr(model, "mtp", None)
        return list(model.model.layers) + (list(head.layers) if head is not None else [])

    def _replace(self, model: nn.Module) -> None:
        counts = {r.original: 0 for r in self.replacements}
        by_class = {r.original: r for r in self.replacements}
        for _, module in model.named_modules():
            r = by_class.get(type(module).__name__)
            if r is None:
                continue
            key = (id(r), type(module))
            if key not in _PREPARED:
                _PREPARED[key] = r.prepared(type(module))
            module.__class__ = _PREPARED[key]
            module.state_index = counts[r.original]
            counts[r.original] += 1
            r.setup(module)

    def _check_layers(self, layers: list[nn.Module]) -> None:
        prepared = set(_PREPARED.values())
        for i, layer in enumerate(layers):
            for child_name, child in layer.named_children():
                cls = type(child)
                if is_fused(child) or cls in prepared or cls.__name__ in self.eager:
                    continue
                raise RecipeError(
                    f"layer {i}.{child_name} is a {cls.__name__}, which the {self.name} recipe neither fuses, "
                    f"replaces nor declares eager: add it to one of them (docs/adding-a-model.md)")

    # -- weights -------------------------------------------------------------------------

    def weights(self, pm: PreparedModel) -> list[WeightSpec]:
        """An arena buffer for every parameter (ties share one; fused projections hold
        their checkpoint tensors in rows) and every constant buffer."""
        model, tp = pm.module, pm.tp
        config = model.config.get_text_config()
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
                parts = tuple(self._fused_part(name, rows, tp, config) for name, rows in fused)
                specs.append(WeightSpec("w." + names[0], tuple(names), (sum(p.rows for p in parts), *full[1:]),
                                        tensors[k].dtype, True, None, parts))
                continue
            shard = self._shard_of(names, tp, config)
            specs.append(WeightSpec("w." + names[0], tuple(names), shard.shape(full) if shard else full,
                                    tensors[k].dtype, True, shard))
        for name, b in model.named_buffers():
            specs.append(WeightSpec("c." + name, (name,), tuple(b.shape), b.dtype, False))
        return specs

    def bind(self, pm: PreparedModel, specs: list[WeightSpec], views: dict[str, torch.Tensor]) -> None:
        """Point every parameter and constant buffer at its arena view."""
        for spec in specs:
            view = views[spec.buffer]
            for path in spec.names:
                owner_path, _, attr = path.rpartition(".")
                owner = pm.module.get_submodule(owner_path)
                if spec.from_checkpoint:
                    owner._parameters[attr] = nn.Parameter(view, requires_grad=False)
                else:
                    owner._buffers[attr] = view

    def compute_constants(self, pm: PreparedModel, specs: list[WeightSpec], views: dict[str, torch.Tensor]) -> None:
        """Constant buffers (rotary frequency tables) are rebuilt on the CPU from the
        owning module's config and copied into the arena."""
        for spec in specs:
            if spec.from_checkpoint:
                continue
            path = spec.names[0]
            owner_path, _, attr = path.rpartition(".")
            owner = pm.module.get_submodule(owner_path)
            with torch.device("cpu"):
                twin = type(owner)(owner.config)
            views[spec.buffer].copy_(getattr(twin, attr))

    def checkpoint_state(self, config_json: str, image: dict[str, torch.Tensor],
                         mtp: bool = False) -> dict[str, torch.Tensor]:
        """A core's image tensors (arena buffer name -> tensor) as a Transformers state dict
        of the canonical model: fused buffers split back into their checkpoint tensors,
        tied names sharing one tensor, computed constants left out. For baselines and
        comparisons that load the core's weights into Transformers' own model (which has no
        MTP head: its ``mtp.*`` weights only with ``mtp``)."""
        pm = self.build(self.config_from_json(config_json), torch.float32)
        state = {}
        for spec in self.weights(pm):
            if spec.from_checkpoint and (mtp or not spec.names[0].startswith("mtp.")):
                state.update(spec.checkpoint_views(image[spec.buffer]))
        return state

    def _fused_part(self, name: str, rows: int, tp: TensorParallel, config) -> WeightPart:
        """A fused buffer concatenates rows, so each part must be sharded by rows (or not at
        all): rank r's buffer is then [part0_r; part1_r; ...]."""
        shard = self._shard_of((name,), tp, config)
        if shard is not None and shard.dim != 0:
            raise ShardingError(f"{name} is fused by rows but declared sharded along dim {shard.dim}")
        return WeightPart(name, rows // tp.size if shard else rows, shard)

    def _shard_of(self, names: Sequence[str], tp: TensorParallel, config) -> Shard | None:
        """The declared partition of a parameter (tied parameters share theirs)."""
        if not tp.active:
            return None
        dims, blocks = set(), set()

        def declared(table: Mapping, owner: str):
            return next((v for suffix, v in table.items() if owner == suffix or owner.endswith("." + suffix)), None)

        for name in names:
            owner, _, attr = name.rpartition(".")
            dim = declared(self.sharding, owner)
            if dim is not None and attr == "bias":
                if dim == 1:
                    raise ShardingError(f"{name}: a row-parallel layer with a bias would add it on every rank")
                dim = 0
            dims.add(dim)
            sizes = declared(self.shard_blocks, owner)
            if sizes is not None and dim != 0:
                raise ShardingError(f"{name}: blocks are declared for a weight not sharded by rows (dim {dim})")
            blocks.add(tuple(sizes(config)) if sizes is not None else ())
        if len(dims) != 1 or len(blocks) != 1:
            raise ShardingError(f"tied parameters {list(names)} are declared with different partitions "
                                f"{dims} / blocks {blocks}")
        dim = dims.pop()
        return None if dim is None else Shard(dim, tp.rank, tp.size, blocks.pop())

    # -- the forward the programs call ------------------------------------------------------

    def forward_tokens(self, pm: PreparedModel, tokens: torch.Tensor, positions: torch.Tensor,
                       batch: PagedBatch) -> torch.Tensor:
        """Final-normed hidden states ``[T, H]`` for packed tokens."""
        for m in pm.batch_readers:
            m.flare_paged = batch
        out = pm.module.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, paged=batch)
        return out.last_hidden_state[0]

    def mtp_forward(self, pm: PreparedModel, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    batch: PagedBatch) -> torch.Tensor:
        """The MTP head's final-normed output ``[T, H]`` (``recipes/mtp.py``)."""
        for m in pm.batch_readers:
            m.flare_paged = batch
        return _mtp.forward(pm.module, tokens, hidden, positions, batch, self.rotary_sections)

    def lm_head(self, pm: PreparedModel, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (gathered from the vocabulary shards)."""
        logits = pm.module.lm_head(hidden)
        return pm.tp.all_gather(logits, dim=-1) if pm.tp.active and self.sharding.get("lm_head") == 0 else logits

    # -- the config as the manifest stores it -------------------------------------------------

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


def _attach_collectives(model: nn.Module, tp: TensorParallel, sharding: Mapping[str, int]) -> None:
    if sharding.get("embed_tokens") == 0:
        model.set_input_embeddings(VocabParallelEmbedding(model.get_input_embeddings().weight, tp))
    row_parallel = tuple(k for k, d in sharding.items() if d == 1 and k not in ("embed_tokens", "lm_head"))
    for name, module in model.named_modules():
        if any(name.endswith("." + suffix) for suffix in row_parallel):
            module.register_forward_hook(lambda _m, _args, out: tp.all_reduce(out))
