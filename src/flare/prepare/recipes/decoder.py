"""Recipe for decoder-only transformers whose every layer is causal attention
(Llama, SmolLM2, Qwen3 dense, Mistral, Qwen2).

The canonical Transformers model is instantiated on the meta device; its
parameters and constant buffers are then re-bound to views of the prepared
arena, so the module tree (names, config, forward) stays Transformers' own.
Only the attention function is replaced (``flare_paged``), and the model is
called on packed tokens with explicit positions. Every layer attends, so layer
``i`` owns KV layer ``i``, and the model carries no continuation state beyond
the final hidden vector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from flare.prepare import attention as _attention  # registers flare_paged
from flare.prepare.attention import PagedBatch


@dataclass(frozen=True)
class WeightSpec:
    buffer: str  # arena buffer name
    names: tuple[str, ...]  # module paths bound to this storage (ties share one buffer)
    shape: tuple[int, ...]
    dtype: torch.dtype
    from_checkpoint: bool  # False for constants computed at preparation (rotary tables)


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int


class DecoderRecipe:
    name = "decoder"
    model_types = ("llama", "qwen3", "qwen2", "mistral")

    def build(self, config, dtype: torch.dtype) -> nn.Module:
        """The canonical model on the meta device, attention replaced."""
        from transformers import AutoModelForCausalLM

        config._attn_implementation = _attention.ATTENTION_NAME
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config._attn_implementation = _attention.ATTENTION_NAME
        model.eval()
        model.requires_grad_(False)
        for i, layer in enumerate(self.decoder_layers(model)):
            layer.self_attn.kv_layer = i
        return model

    def weights(self, model: nn.Module) -> list[WeightSpec]:
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
        specs = [
            WeightSpec("w." + names[0], tuple(names), tuple(tensors[k].shape), tensors[k].dtype, True)
            for k, names in groups.items()
        ]
        for name, b in model.named_buffers():
            specs.append(WeightSpec("c." + name, (name,), tuple(b.shape), b.dtype, False))
        return specs

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

    def kv_geometry(self, config) -> KVGeometry:
        config = config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVGeometry(config.num_hidden_layers, config.num_key_value_heads, head_dim)

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
        return model.lm_head(hidden)

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
