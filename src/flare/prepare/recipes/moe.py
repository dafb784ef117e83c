"""Routed experts as a prepared module, and the Qwen3-MoE recipe.

Transformers' sparse MoE blocks (``Qwen3MoeSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``,
...) route with a ``gate`` (the router, ``weight [E, H]``, ``top_k``,
``norm_topk_prob``) and run ``experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``) in a loop over the experts that were hit, chosen on the host: it cannot be
captured. ``prepared_moe`` gives such a block a forward over static shapes
(``kernels/moe.py``): the router as Transformers computes it with deterministic ties,
padded rows routed nowhere, the grouped expert GEMMs on the CUDA path (any CUDA tensor,
or ``paged.impl == "triton"`` under Triton's CPU interpreter) or the same arithmetic in
torch on the CPU reference path, and the shared expert with its sigmoid gate where the
block has one (in decode steps of a single rank inside the routed decode kernels, as one
more pair of every token; otherwise inside the compiled layer). The experts' activation must be SiLU (checked when the block is replaced). Parameter names are Transformers' (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ...), so checkpoints load as they are.

The block's forward is called without the program's batch (Transformers' decoder layer
passes it only to attention); the recipe base hands it the batch before each forward
(``Recipe.forward_tokens``: modules of a class with ``reads_batch`` get ``flare_paged``).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from flare.prepare import prompt_rows
from flare.prepare.attention import PagedBatch
from flare.prepare.kernels import moe as K
from flare.prepare.parallel import SINGLE, TensorParallel
from flare.prepare.recipes.base import Recipe, RecipeError, Replacement
from flare.prepare.recipes.decoder import DECODER_SHARDING
from flare.prepare.recipes.fused import SILU_ACTS as _SILU, FusedLinear, fuse_mlp



def _triton(x: torch.Tensor, paged: PagedBatch | None) -> bool:
    return x.is_cuda or (paged is not None and paged.impl == "triton")


def _routed(block, x: torch.Tensor, paged: PagedBatch | None, shared: bool = False,
            residual: torch.Tensor | None = None, norm=None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The routed experts' output for hidden rows ``x [T, H]``, and, for a block with a gated
    shared expert (``shared``), the shared expert's gate logits ``[T, 1]``: or None where
    the output already includes the shared expert (a decode-sized step of a single rank runs
    it inside the routed decode kernels, as one more pair of every token: ``_folds_shared``);
    and whether the output includes ``residual`` (``[T, H]``, the decoder layer's: the decode
    kernels add it where the shared expert is folded or there is none, a single rank).
    With tensor parallelism each rank holds a contiguous slice of the experts: the
    (replicated) router picks among all of them, a rank computes the pairs routed to its
    own, and the partial outputs are all-reduced.

    ``norm`` (a ``gemv.Norm`` with the decoder layer's residual, where ``_takes_norm`` holds): x is
    the attention's output, and the router's and the experts' launches take the add and the
    post-attention norm in their loads (``router_gemv``'s ``norm``); the output includes the sum."""
    gate, experts = block.gate, block.experts
    valid = paged.valid if paged is not None else None
    # Qwen3.5-MoE's router always renormalises (it has no norm_topk_prob).
    renorm = getattr(gate, "norm_topk_prob", True)
    # The torch form loops over the hit experts on the host: a CPU reference, never captured.
    triton = _triton(x, paged)
    local = experts.gate_up_proj.shape[0]
    split = local != gate.weight.shape[0]
    T, k = x.shape[0], gate.top_k
    # The expert GEMVs (no plan) for decode-sized steps; prompt programs always tile, so that a
    # prompt row is computed the same in a 16-row prefill as in a 2,048-row one.
    decode = triton and T * k <= K.DECODE_PAIRS and not prompt_rows.active()
    # Hopper's programmatic dependent launch for the router and both expert launches (``--dependent-launch``).
    pdl = decode and block.flare_dependent_launch
    # The router's logits in the model dtype, as Transformers computes them; on the Triton path
    # with the whole of K summed in order for each row, so that a token routes the same
    # whatever it is batched with: in decode steps a GEMV program per token and block of
    # experts (the shared expert's gate in the same launch), in prompt programs by fixed tiles.
    s_gate = block.shared_expert_gate if shared else None  # Linear(H, 1): one column
    routed = None
    if decode:
        # With the core's ticket counters the router's last program for each token routes it too.
        tickets = block.flare_route_tickets
        route = None if tickets is None else (k, renorm, valid, tickets)
        logits, gate_logits, *routed = K.router_gemv(x, gate.weight, s_gate.weight if shared else None, route=route,
                                                     norm=norm, pdl=pdl)
        if norm is not None:
            *routed, x = routed
            residual = x  # (the sum: the experts normalise it in their loads and add it after)
    elif norm is not None:
        raise ValueError("a MoE block takes the post-attention norm only in a decode step's router launch")
    elif triton:
        logits = K.invariant_linear(x, gate.weight)
        gate_logits = K.invariant_linear(x, s_gate.weight) if shared else None
    else:
        logits = F.linear(x, gate.weight)
        gate_logits = F.linear(x, s_gate.weight) if shared else None
    if shared and s_gate.bias is not None:
        gate_logits = gate_logits + s_gate.bias
    # Every program routes a token by itself (one Triton program per token), so that it gets
    # the same weights in a decode step and in a prefill chunk of any capacity: a cache-on
    # turn prefills its suffix in a smaller program than the cache-off turn's whole prompt.
    # (torch's softmax and sums over [T, E] agree across capacities only to float32 rounding.)
    if routed:
        weights, ids = routed
    else:
        weights, ids = K.route_rows(logits, k, renorm, valid) if triton else K.route_logits(logits, k, renorm, valid)
    if split:
        ids = ids - block.flare_tp.rank * local
        outside = (ids < 0) | (ids >= local)
        ids, weights = torch.where(outside, local, ids), torch.where(outside, 0.0, weights)
    args = (x, weights, ids, experts.gate_up_proj, experts.down_proj)
    if residual is not None and (residual.stride(-1) != 1 or residual.dtype != x.dtype):
        residual = None  # (the kernel reads rows of unit stride in x's dtype: the add stays apart)
    if decode and not split and (not shared or _folds_shared(block)):  # GEMVs, no tiles
        folded = None
        if shared:
            s = block.shared_expert
            folded = (s.gate_up_proj.weight, s.down_proj.weight, gate_logits)
        return (K.experts_decode(*args, shared=folded, residual=residual, norm=norm, pdl=pdl), None,
                residual is not None)
    if decode:
        out = K.experts_decode(*args, pdl=pdl)
    else:
        out = K.experts_triton(*args) if triton else K.experts_torch(*args)
    return block.flare_tp.all_reduce(out) if split else out, gate_logits, False


def _takes_norm(block, norm, residual: torch.Tensor, x: torch.Tensor):
    """The ``gemv.Norm`` (with the residual's rows) with which a decode step's router and experts
    take the decoder layer's add and post-attention norm in their loads (``_routed``'s ``norm``):
    where the step routes in the router's launch (the core's ticket counters: a CUDA core), the
    block's decode kernels add the residual (a single rank, the shared expert folded or none) and
    the norm offers itself (``flare_gemv_norm``: a step's row-invariant norm in x's dtype); None
    elsewhere (``add_norm`` and the block apart). Shapes and attributes only: compiled code asks."""
    from flare.prepare.recipes.fused import hooked

    gate, experts = block.gate, block.experts
    rows = x.numel() // x.shape[-1]
    offer = getattr(norm, "flare_gemv_norm", None)
    if (block.flare_route_tickets is None or offer is None or hooked(block) or hooked(norm) or prompt_rows.active()
            or rows * gate.top_k > K.DECODE_PAIRS or experts.gate_up_proj.shape[0] != gate.weight.shape[0]
            or block.flare_tp.active or (getattr(block, "shared_expert", None) is not None and not _folds_shared(block))
            or residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    x2, r2 = x.reshape(rows, x.shape[-1]), residual.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        return None
    return offer(x2, r2)


def _folds_shared(block) -> bool:
    """Whether decode steps run the block's shared expert inside the routed kernels: a single
    rank (a tensor-parallel rank holds a shard of the shared expert, not all of it), a fused
    gate/up GEMM of SiLU without biases (what the kernels compute)."""
    s = block.shared_expert
    fused = getattr(s, "gate_up_proj", None)
    return (not block.flare_tp.active and isinstance(fused, FusedLinear) and fused.bias is None
            and s.down_proj.bias is None and type(s.act_fn).__name__ in _SILU)


def prepared_moe(base: type) -> type:
    class PreparedSparseMoe(base):
        """A Transformers sparse MoE block over static shapes (module docstring)."""

        reads_batch = True
        flare_paged: PagedBatch | None = None
        flare_tp: TensorParallel = SINGLE  # set by the recipe base for a tensor-parallel rank
        # The core's ticket counters (CUDA cores: ``build``): decode steps route in the router's launch.
        flare_route_tickets: torch.Tensor | None = None
        # ``--dependent-launch on`` (CUDA, SM90+): decode steps launch the router and the experts dependent.
        flare_dependent_launch: bool = False

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.flare_residual_forward(hidden_states, None)[0]

        def flare_residual_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None
                                   ) -> tuple[torch.Tensor, bool]:
            """(the block's output, whether it includes ``residual``): the decoder layer's residual
            (``fused.mlp_residual``, its add after the MLP), which a decode step's down kernel adds
            on a single rank where the shared expert is folded or there is none (``_routed``: a
            launch fewer a layer); elsewhere the caller adds it, in its own code after this
            frame's graph break, so that a compiled program rounds the block's output before the
            add as it did (Inductor would otherwise fuse the shared expert's gated sum with the
            add, rounding once)."""
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            r = None if residual is None else residual.reshape(-1, residual.shape[-1])
            out, gate, added = self._experts(x, r)
            if gate is not None:
                # The shared expert inside the compiled layer, as a dense model's MLP runs (one
                # gate/up GEMM, the activation fused, the down GEMM, then the gated sum fused): run
                # eagerly beside the routed experts it took 9 kernels a layer on the H200, its
                # gate/up GEMM at 0.3 TB/s in a transposed cuBLAS layout. (Decode steps run it
                # inside the routed kernels: no gate then.)
                out = out + F.sigmoid(gate) * self.shared_expert(x)
            return out.reshape(hidden_states.shape), added

        def flare_norm_residual_forward(self, norm, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
            """``residual + x`` plus this block of ``norm(residual + x)``, a decoder layer's add, its
            post-attention norm, this block and the add after it (``fused.add_norm_mlp``), with the
            add and the norm in the router's and the experts' loads where a decode step allows
            (``_takes_norm``: no norm launch); None elsewhere."""
            spec = _takes_norm(self, norm, residual, x)
            if spec is None:
                return None
            return self._experts_normed(x.reshape(spec.residual.shape), spec).reshape(x.shape)

        # Outside the compiled layer: the batch is a plain attribute (a compiled forward
        # would guard on it per program), and the plan and kernels run as written.
        @torch.compiler.disable
        def _experts(self, x: torch.Tensor, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
            """``_routed``'s (output, shared expert's gate logits or None, residual added)."""
            return _routed(self, x, self.flare_paged, getattr(self, "shared_expert", None) is not None, residual)

        @torch.compiler.disable
        def _experts_normed(self, x: torch.Tensor, spec) -> torch.Tensor:
            """``_routed``'s output with ``spec``'s add and norm in the loads (it includes the sum)."""
            shared = getattr(self, "shared_expert", None) is not None
            return _routed(self, x, self.flare_paged, shared, spec.residual, norm=spec)[0]

    return PreparedSparseMoe


def check_moe(block) -> None:
    """Run on every replaced block: the grouped kernels compute act(gate) * up with SiLU;
    a shared expert gets one gate/up GEMM."""
    act = getattr(block.experts, "act_fn", None)
    if type(act).__name__ not in _SILU:
        raise RecipeError(f"{type(block).__name__}: experts with activation {type(act).__name__} are not supported "
                          f"(the grouped kernels compute SiLU)")
    shared = getattr(block, "shared_expert", None)
    if shared is not None and not fuse_mlp(shared):
        raise RecipeError(f"{type(block).__name__}: its shared expert {type(shared).__name__} cannot be fused")


class Qwen3MoeRecipe(Recipe):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (fused q/k/v with
    per-head q/k norms), routed experts in every sparse layer, dense MLPs (fused
    gate/up) in ``mlp_only_layers``. Tensor parallelism: attention heads and dense MLPs
    as the decoder recipe's, the experts split across ranks (dim 0 of both expert
    tensors), the router replicated."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    sharding = {**DECODER_SHARDING, "mlp.experts": 0}
    divided_dims = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "num_experts", "vocab_size")
    eager = frozenset({"Qwen3MoeRMSNorm"})
    replacements = (Replacement("Qwen3MoeSparseMoeBlock", prepared_moe, setup=check_moe),)
