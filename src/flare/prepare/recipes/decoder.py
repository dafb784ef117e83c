"""Recipe for decoder-only transformers whose every layer is causal attention
(Llama, SmolLM2, Qwen3 dense, Mistral, Qwen2).

Everything is the recipe base's (``recipes/base.py``): the canonical module tree,
paged attention in every layer (layer ``i`` owns KV layer ``i``), q/k/v and
gate/up fused, and no continuation state beyond the final hidden vector.

Tensor parallelism (docs/tensor-parallel.md): with a TP size N > 1 each rank's
weights are its slice of the declared dimension (heads, MLP intermediates,
vocabulary), everything else is replicated; row-parallel layers all-reduce their
output, the embedding looks up only its own vocabulary rows and all-reduces, and
``lm_head`` all-gathers the logits before the sampler.
"""

from __future__ import annotations

from flare.prepare.recipes.base import Recipe

# Column-parallel layers (dim 0 of a Linear) keep whole heads / intermediate rows and
# need nothing after them; row-parallel layers (dim 1) produce partial sums that are
# all-reduced; the embedding (dim 0, vocabulary rows) is a masked lookup plus
# all-reduce, and lm_head (the same rows, tied or not) is all-gathered.
DECODER_SHARDING = {
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


class DecoderRecipe(Recipe):
    name = "decoder"
    model_types = ("llama", "qwen3", "qwen2", "mistral")
    sharding = DECODER_SHARDING
    divided_dims = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    # Attention and MLP are fused (recipes/fused.py); the norms run as written.
    eager = frozenset({"LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
