"""Tensor parallelism on the CPU reference path (docs/tensor-parallel.md).

A TP=2 core of ``llama-tiny`` (two preparation processes over gloo, each writing
its rank's image) is driven by the real runtime executor (two rank workers in a
gloo group) with exactly the writes the scheduler stages, next to the TP=1 core
prepared with the same options; then served by ``flare-serve``.

Bound (derived, then measured). Let z be the exact logits and err32 = max |hf32 -
hf64| over every compared position and vocabulary entry: the rounding error of
one valid float32 evaluation order of this network on these inputs (the float64
Transformers model stands for z, as in test_programs.py). TP=1 and TP=2 evaluate
the same function in float32 in other orders (TP=2 also splits every row-parallel
sum into two partial sums added by the all-reduce, and the attention heads over
ranks); allowing each an error of up to 3 * err32 as test_programs.py does,

    |tp2 - tp1| <= |tp2 - z| + |z - tp1| <= 6 * err32   (+ 1e-6, never zero).

Argmax must agree at every position unless the float64 gap between the two tokens
lies within the bound (a near-tie float32 cannot resolve). On the development
machine (``pytest -s`` prints them): err32 = 5.05e-7, bound = 4.03e-6,
max |tp2 - tp1| = 2.98e-7 over 507 rows, no argmax disagreement, greedy
generations identical.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np
import openai
import pytest

from flare.core import interface as io
from flare.core import manifest as mf
from flare.core.errors import ManifestError
from flare.core.manifest import ProgramKind
from flare.core.sampling_params import NEUTRAL
from flare.runtime.reference import ReferenceExecutor
from tests.conftest import TINY_OPTS, TORCH_THREADS, prepare_core, running_server, scrape_metrics

PROMPT_LENGTHS = (5, 40, 130, 300)  # one chunk, two chunks (128 + 2), three chunks; page size 16
FORCED_STEPS = 8  # teacher-forced decode steps, all prompts in one batch
GREEDY_STEPS = 24


@pytest.fixture(scope="module")
def tp2_core() -> Path:
    return prepare_core("llama-tiny", [*TINY_OPTS, "--tp", "2"])


# ---------------------------------------------------------------------------
# Driving a core through the executor with the scheduler's writes


class Driver:
    """The runtime executor (every rank) driven by hand, one program at a time."""

    def __init__(self, ex: ReferenceExecutor):
        self.ex = ex
        self.m = ex.manifest
        self.next_page = 1

    async def run(self, program: str) -> None:
        self.ex.submit(program)
        await self.ex.wait()

    async def admit(self, slot: int, prompt: list[int]) -> None:
        c, w = self.m.capacities, self.ex.write
        pages = list(range(self.next_page, self.next_page + -(-(len(prompt) + GREEDY_STEPS + 1) // 16)))
        self.next_page += len(pages)
        # Greedy (top_k 1); no stop token: generations run their full length.
        for name, value in io.slot_state(pending=0, generated=0, max_new=4096, seed=slot,
                                         sampling={**NEUTRAL, "top_k": 1}, stop_ids=(), stop_capacity=c.stop_ids,
                                         pages=pages, max_pages=c.max_pages_per_slot, mask_on=False,
                                         logprobs=True).items():
            w(name, value, slot)
        C = self.m.programs_of(ProgramKind.admit)[0].capacity
        for i in range(0, len(prompt), C):
            chunk = np.array(prompt[i : i + C], dtype=np.int32)
            w(io.TOKENS, chunk)
            w(io.AdmitInput.buffer, io.pack(io.AdmitInput(slot, len(chunk), int(i == 0), io.AdmitMode.prompt)))
            await self.run(f"admit.{C}")

    async def prefill(self, slot: int, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Every chunk; (hidden rows [L, H], out.logits of the last token, sampled token)."""
        C, rows = self.m.capacities.prefill_chunk, []
        for start in range(0, len(prompt), C):
            chunk = np.array(prompt[start : start + C], dtype=np.int32)
            cap = next(c for c in self.m.capacities.prefill_capacities if c >= len(chunk))
            self.ex.write(io.TOKENS, chunk)
            self.ex.write(io.PrefillInput.buffer,
                          io.pack(io.PrefillInput(slot, len(chunk), int(start + len(chunk) == len(prompt)))))
            await self.run(f"prefill.{cap}")
            rows.append(self.ex.read("out.prefill_hidden")[: len(chunk)])
        record = io.completion(self.ex.read(io.PREFILL_COMPLETION)[0])
        return np.concatenate(rows), self.ex.read("out.logits")[0], record.token

    async def decode(self, slots: list[int], forced: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """One step for ``slots``; ``forced`` overrides their pending tokens (teacher forcing).
        Returns (out.logits rows, sampled tokens)."""
        cap = next(c for c in self.m.capacities.decode_capacities if c >= len(slots))
        for s, t in zip(slots, forced or ()):
            self.ex.write("state.pending", np.array(t), s)
        batch = np.zeros(max(self.m.capacities.decode_capacities), dtype=np.int32)
        batch[: len(slots)] = slots
        self.ex.write(io.DECODE_SLOTS, batch)
        await self.run(f"decode.{cap}")
        records = [io.completion(r) for r in self.ex.read(io.DECODE_COMPLETION)[: len(slots)]]
        return self.ex.read("out.logits")[: len(slots)], np.array([r.token for r in records])


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENGTHS]


async def _drive(core: Path, prompts: list[list[int]], forced: list[list[int]]) -> dict:
    m = mf.load_manifest(core)
    ex = ReferenceExecutor(core, m, torch_threads=TORCH_THREADS)
    await ex.start()
    try:
        d = Driver(ex)
        slots = list(range(1, len(prompts) + 1))
        out: dict = {"prefill_hidden": [], "prefill_logits": [], "decode_logits": [], "greedy": [], "greedy_logits": []}
        # Teacher forcing: every prompt, then FORCED_STEPS batched steps of given tokens.
        for s, p in zip(slots, prompts):
            await d.admit(s, p)
            hidden, last, _ = await d.prefill(s, p)
            out["prefill_hidden"].append(hidden)
            out["prefill_logits"].append(last)
        for step in range(FORCED_STEPS):
            logits, _ = await d.decode(slots, [f[step] for f in forced])
            out["decode_logits"].append(logits)
        # Greedy generation (top_k = 1) from fresh slots, the prompts decoded together.
        gen = [s + len(prompts) for s in slots]
        first = []
        for s, p in zip(gen, prompts):
            await d.admit(s, p)
            first.append((await d.prefill(s, p))[2])
        tokens = [first]
        for _ in range(GREEDY_STEPS - 1):
            logits, tok = await d.decode(gen, None)
            out["greedy_logits"].append(logits)
            tokens.append(tok.tolist())
        out["greedy"] = [list(t) for t in zip(*tokens)]
        out["pids"] = ex.worker_pids()
        return out
    finally:
        await ex.close()


@pytest.fixture(scope="module")
def runs(tiny_core, tp2_core) -> dict:
    m1, m2 = mf.load_manifest(tiny_core), mf.load_manifest(tp2_core)
    assert (m1.parallel.tp_size, m2.parallel.tp_size) == (1, 2)
    assert m2.buffer("kv").shape[4] * 2 == m1.buffer("kv").shape[4]  # each rank holds half the KV heads
    prompts = _prompts(m1.capacities.sampling_vocab)
    rng = np.random.default_rng(8)
    forced = [rng.integers(3, m1.capacities.sampling_vocab, FORCED_STEPS).tolist() for _ in prompts]
    tp1 = asyncio.run(_drive(tiny_core, prompts, forced))
    tp2 = asyncio.run(_drive(tp2_core, prompts, forced))
    return {"prompts": prompts, "forced": forced, "tp1": tp1, "tp2": tp2, "manifest": m1}


@pytest.fixture(scope="module")
def hf_logits(tiny_core, runs) -> tuple[list, list]:
    """Transformers' float32 and float64 logits over every teacher-forced sequence, with
    the TP=1 core's weights (tied embedding; rotary tables Transformers' own)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from flare.prepare.recipes import by_name

    m = runs["manifest"]
    recipe = by_name(m.reference.recipe)
    config = recipe.config_from_json(m.reference.config)
    config._attn_implementation = "eager"
    weights = load_file(str(tiny_core / m.arena.image))
    out = []
    for dtype in (torch.float32, torch.float64):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        specs = recipe.weights(recipe.build(recipe.config_from_json(m.reference.config), torch.float32))
        state = {}
        for s in specs:
            if s.from_checkpoint:
                state.update(s.checkpoint_views(weights[s.buffer].to(dtype)))
        model.load_state_dict(state, strict=True, assign=True)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
        model = model.to(dtype).eval()
        with torch.no_grad():
            out.append([model(torch.tensor([p + f])).logits[0].double().numpy()
                        for p, f in zip(runs["prompts"], runs["forced"])])
    return out[0], out[1]


def _rows(run: dict, prompts, emb64: np.ndarray) -> list[np.ndarray]:
    """Per prompt: logits at every prompt position (hidden @ embedding^T in float64)
    then at every teacher-forced step (the program's own float32 out.logits)."""
    rows = []
    for i, hidden in enumerate(run["prefill_hidden"]):
        steps = np.stack([step[i] for step in run["decode_logits"]])
        rows.append(np.concatenate([hidden.astype(np.float64) @ emb64.T, steps.astype(np.float64)]))
    return rows


def test_tp2_teacher_forced_logits_match_tp1(tiny_core, runs, hf_logits):
    hf32, hf64 = hf_logits
    prompts = runs["prompts"]
    # Positions compared: every prompt position and every teacher-forced decode step.
    err32 = max(np.abs(a - b).max() for a, b in zip(hf32, hf64))
    bound = 6 * err32 + 1e-6
    from safetensors.numpy import load_file

    emb = load_file(str(tiny_core / runs["manifest"].arena.image))["w.model.embed_tokens.weight"].astype(np.float64)
    r1, r2 = _rows(runs["tp1"], prompts, emb), _rows(runs["tp2"], prompts, emb)
    worst, flips, n = 0.0, [], 0
    for i, (a, b, ref) in enumerate(zip(r1, r2, hf64)):
        a, b = a[: ref.shape[0]], b[: ref.shape[0]]
        n += a.shape[0]
        worst = max(worst, float(np.abs(a - b).max()))
        for pos in np.nonzero(a.argmax(-1) != b.argmax(-1))[0]:
            t1, t2 = a[pos].argmax(), b[pos].argmax()
            flips.append((i, int(pos), float(abs(ref[pos, t1] - ref[pos, t2]))))
    # The last prompt token's out.logits (the TP path's gathered lm_head) against TP=1's.
    for a, b in zip(runs["tp1"]["prefill_logits"], runs["tp2"]["prefill_logits"]):
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()))
    print(f"\nTP=2 vs TP=1: err32 = {err32:.3g}, bound = {bound:.3g}, max |tp2 - tp1| = {worst:.3g} "
          f"over {n} rows, argmax flips {flips}")
    assert n == sum(PROMPT_LENGTHS) + len(prompts) * FORCED_STEPS
    assert worst <= bound
    assert all(gap <= bound for _, _, gap in flips), flips


def test_tp2_greedy_generations_equal_tp1(runs):
    g1, g2 = runs["tp1"]["greedy"], runs["tp2"]["greedy"]
    assert all(len(g) == GREEDY_STEPS for g in g1 + g2)
    for i, (a, b) in enumerate(zip(g1, g2)):
        if a != b:  # a flip is acceptable only as a float32 near-tie of TP=1's own logits
            k = next(j for j in range(GREEDY_STEPS) if a[j] != b[j])
            logits = runs["tp1"]["greedy_logits"][k - 1][i] if k else runs["tp1"]["prefill_logits"][i]
            pytest.fail(f"prompt {i}: generations diverge at step {k} ({a[k]} vs {b[k]}), "
                        f"TP=1 logit gap {abs(float(logits[a[k]]) - float(logits[b[k]])):.3g}")
    assert len({tuple(g) for g in g1}) == len(g1)  # distinct prompts generate distinct text


def test_tp2_workers_are_gone_after_close(runs):
    """close() reaps every rank's worker (no rank left behind in the gloo group)."""
    assert len(runs["tp2"]["pids"]) == 2 and len(runs["tp1"]["pids"]) == 1
    for pid in runs["tp2"]["pids"]:
        assert not Path(f"/proc/{pid}").exists()


# ---------------------------------------------------------------------------
# The contract: rank images and sharding errors


def test_tp2_core_layout(tp2_core):
    m = mf.load_manifest(tp2_core)
    assert m.parallel == mf.Parallel(tp_size=2, ranks=(mf.RankCore(dir="rank0", base_address=0),
                                                       mf.RankCore(dir="rank1", base_address=0)))
    assert [p.name for p in mf.rank_images(tp2_core, m)] == ["weights.safetensors"] * 2
    assert not (tp2_core / "weights.safetensors").exists()
    # Vocabulary rows, heads and intermediates are halved; norms replicated.
    assert m.buffer("w.model.embed_tokens.weight").shape == (49152 // 2, 64)
    # q/k/v and gate/up are one buffer each: a rank holds [q_r; k_r; v_r] (heads) and
    # [gate_r; up_r] (intermediate rows).
    assert m.buffer("w.model.layers.0.self_attn.qkv_proj.weight").shape == ((4 + 2 + 2) // 2 * 16, 64)
    assert m.buffer("w.model.layers.0.mlp.gate_up_proj.weight").shape == (2 * 128 // 2, 64)
    assert m.buffer("w.model.layers.0.self_attn.o_proj.weight").shape == (64, 64 // 2)
    assert m.buffer("w.model.layers.0.mlp.down_proj.weight").shape == (64, 128 // 2)
    assert m.buffer("w.model.norm.weight").shape == (64,)
    assert m.capacities.vocab_size == 49152  # logits are gathered: the runtime sees the whole vocabulary


def test_missing_rank_image_rejects_the_core(tp2_core, tmp_path):
    core = tmp_path / "core"
    shutil.copytree(tp2_core, core, ignore=shutil.ignore_patterns("rank1"))
    with pytest.raises(ManifestError, match=r"lacks rank 1's arena image rank1/weights\.safetensors") as e:
        mf.load_manifest(core)
    assert e.value.param == "parallel.ranks[1]"
    raw = json.loads((tp2_core / mf.MANIFEST_FILE).read_bytes())
    raw["parallel"]["tp_size"] = 3
    with pytest.raises(ManifestError, match="lists 2 ranks for tp_size 3") as e:
        mf.decode_manifest(json.dumps(raw).encode())
    assert e.value.param == "parallel.ranks"


def test_cuda_executor_drives_one_rank_of_a_tp_core(tp2_core):
    """A single-rank CUDA executor opened on a TP core without naming its rank is refused
    with a typed error before any device work (``cuda_tp.open_executor`` drives every
    rank); with a rank it reads that rank's directory and fixed address."""
    pytest.importorskip("cuda.bindings")
    from flare.core.errors import CoreCompatibilityError
    from flare.runtime.cuda_executor import CudaExecutor

    m = mf.load_manifest(tp2_core)
    with pytest.raises(CoreCompatibilityError, match="tensor-parallel") as e:
        CudaExecutor(tp2_core, m)
    assert (e.value.param, e.value.code) == ("parallel.tp_size", "tensor_parallel_core")
    one = CudaExecutor(tp2_core, m, rank=1)
    assert one.rank_dir == tp2_core / "rank1" and one.base_address == m.parallel.ranks[1].base_address


class _Rank:
    """A stand-in for one rank's CudaExecutor (no GPU here): records what it is asked."""

    def __init__(self, i: int, log: list, fail_submit: bool = False, fail_wait: bool = False):
        self.i, self.log, self.fail_submit, self.fail_wait, self.tickets = i, log, fail_submit, fail_wait, 0

    def write(self, buffer, value, row=None):
        self.log.append(("write", self.i, buffer))

    def submit(self, program):
        if self.fail_submit:
            from flare.core.errors import ExecutionError

            raise ExecutionError("cuGraphLaunch failed: CUDA_ERROR_LAUNCH_FAILED")
        self.log.append(("submit", self.i, program))
        self.tickets += 1
        return self.tickets - 1

    async def wait(self, ticket=None):
        if self.fail_wait:
            from flare.core.errors import ExecutionError

            raise ExecutionError("program failed on the device: CUDA_ERROR_ILLEGAL_INSTRUCTION", code="device_error")

    def completion(self, ticket):
        return np.array([self.i])

    def stats(self):
        return {"launches": self.tickets, "allocations_after_ready": self.i, "device_free_now": 7}


def test_cuda_tp_executor_drives_every_rank_and_names_a_failed_one(tp2_core):
    """TensorParallelExecutor's own logic (its ranks stand in for CudaExecutors: no GPU
    here; tests/gpu/test_tensor_parallel_cuda.py runs the real ones): writes and
    launches reach every rank in rank order, completions are rank 0's, counters after
    ready add up, and a rank that fails to launch or fails on the device is named,
    after which nothing more is written or launched."""
    pytest.importorskip("cuda.bindings")
    from flare.core.errors import ExecutionError
    from flare.runtime.cuda_tp import TensorParallelExecutor

    ex = TensorParallelExecutor(tp2_core, mf.load_manifest(tp2_core), devices=1)
    assert [(r.rank, r.ordinal, r.rank_dir.name) for r in ex.ranks] == [(0, 0, "rank0"), (1, 0, "rank1")]
    log: list = []
    ex.ranks = [_Rank(0, log), _Rank(1, log)]
    ex.write("in.tokens", np.zeros(3, np.int32))
    assert ex.submit("decode.1") == 0
    assert log == [("write", 0, "in.tokens"), ("write", 1, "in.tokens"), ("submit", 0, "decode.1"),
                   ("submit", 1, "decode.1")]
    asyncio.run(ex.wait(0))
    assert ex.completion(0).tolist() == [0]
    assert ex.stats()["allocations_after_ready"] == 1 and ex.stats()["tp_size"] == 2

    ex.ranks[1].fail_submit = True
    with pytest.raises(ExecutionError, match="rank 1 could not launch decode.1") as e:
        ex.submit("decode.1")
    assert e.value.code == "rank_failed"
    with pytest.raises(ExecutionError, match="a rank failed earlier: rank 1"):
        ex.write("in.tokens", np.zeros(3, np.int32))

    ex = TensorParallelExecutor(tp2_core, mf.load_manifest(tp2_core), devices=1)
    ex.ranks = [_Rank(0, log), _Rank(1, log, fail_wait=True)]
    ex.submit("decode.1")
    with pytest.raises(ExecutionError, match="rank 1: program failed on the device") as e:
        asyncio.run(ex.wait())
    assert e.value.code == "device_error"
    with pytest.raises(ExecutionError, match="a rank failed earlier"):
        ex.submit("decode.1")


def test_collective_buffers_hold_the_largest_payload():
    """The exchange slots hold a full prefill chunk's hidden rows and a decode batch's
    logit shard; the CUDA collective refuses a payload that does not fit, before launching."""
    import torch

    from flare.prepare.plan import TP_EXCHANGE, TP_FLAGS, TP_PEERS, collective_buffers
    from flare.prepare.kernels import collective as C

    caps = mf.Capacities(context_limit=4096, prefill_chunk=512, prefill_capacities=(128, 512),
                         decode_capacities=(1, 2, 4), slots=4, max_pages_per_slot=256, stop_ids=16,
                         vocab_size=128256, sampling_vocab=128256, hidden_size=4096, snapshot_rows=16)
    reqs = {r.name: r for r in collective_buffers(caps, 2, 2)}
    slot = reqs[TP_EXCHANGE].shape[0] // 2
    assert slot >= 512 * 4096 * 2 and slot >= 4 * 128256 // 2 * 2 and slot % 256 == 0
    assert reqs[TP_FLAGS].shape == (C.BLOCKS,) and reqs[TP_PEERS].shape == (2,)
    assert reqs[TP_PEERS].role == mf.BufferRole.weight and reqs[TP_FLAGS].role == mf.BufferRole.state
    wide = msgspec.structs.replace(caps, prefill_capacities=(64,), decode_capacities=(1, 256), vocab_size=32000)
    slot = {r.name: r for r in collective_buffers(wide, 8, 2)}[TP_EXCHANGE].shape[0] // 2
    assert slot >= 256 * 4096 * 2  # a decode batch's hidden rows can be the largest payload
    exchange = torch.zeros(2 * 1024, dtype=torch.uint8)
    flags = torch.zeros(C.BLOCKS, dtype=torch.int32)
    peers = torch.zeros(2, dtype=torch.int64)
    x = torch.zeros(513, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceeds the exchange slot"):
        C.launch(C.SUM, x, x, exchange, flags, peers, rank=0, size=2)
    with pytest.raises(ValueError, match="bad rank set"):
        C.launch(C.SUM, x[:4], x[:4], exchange, flags, peers, rank=2, size=2)
    with pytest.raises(ValueError, match="gather"):
        C.launch(C.GATHER, x[:4], x[:4], exchange, flags, peers, rank=0, size=2)


def test_collective_loopback_advances_the_epoch_and_alternates_slots():
    """The CUDA collective kernel (Triton's interpreter here) with every peer offset
    zero, as preparation's warmup runs it: it completes alone, each program publishes
    epoch e = previous + 1 and writes its payload into exchange slot e % 2, and the
    combine reads every "rank" (here all the same one): SUM doubles, GATHER repeats,
    FROM_ZERO keeps. The two-rank protocol runs on the GPU (tests/gpu)."""
    pytest.importorskip("triton")
    import torch

    from flare.prepare.kernels import collective as C

    exchange = torch.zeros(2 * 8192, dtype=torch.uint8)
    flags = torch.zeros(C.BLOCKS, dtype=torch.int32)
    peers = torch.zeros(2, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 700, generator=g).to(torch.bfloat16)  # 2,100 elements: two programs' blocks
    sent = x.clone()
    C.launch(C.SUM, x, x, exchange, flags, peers, rank=1, size=2)
    assert torch.equal(x, (sent.float() * 2).to(torch.bfloat16))
    assert flags.tolist() == [1] * C.BLOCKS
    slot = exchange.view(torch.bfloat16)[4096:4096 + sent.numel()]  # epoch 1: slot 1
    assert torch.equal(slot, sent.reshape(-1))
    out = torch.empty(3, 1400, dtype=torch.bfloat16)
    C.launch(C.GATHER, sent, out, exchange, flags, peers, rank=0, size=2)
    assert torch.equal(out, torch.cat([sent, sent], dim=-1)) and flags.tolist() == [2] * C.BLOCKS
    assert torch.equal(exchange.view(torch.bfloat16)[:sent.numel()], sent.reshape(-1))  # epoch 2: slot 0
    tok = torch.tensor([5, -1, 1 << 40], dtype=torch.int64)
    C.launch(C.FROM_ZERO, tok, tok, exchange, flags, peers, rank=1, size=2)
    assert tok.tolist() == [5, -1, 1 << 40] and flags.tolist() == [3] * C.BLOCKS


def test_rank_arena_addresses_are_disjoint():
    pytest.importorskip("cuda.bindings")
    from flare.prepare.plan import _rank_base
    from flare.prepare.cuda.session import VA_RESERVE, rank_base

    base0 = 0x7F0000000000
    assert [_rank_base(rank_base(base0, me), me, r) for me in (0, 1, 2) for r in range(3)] == \
        [base0, base0 - VA_RESERVE, base0 - 2 * VA_RESERVE] * 3
    assert _rank_base(0, 1, 1) == 0  # reference cores have no addresses


@pytest.mark.parametrize("tp,dim,n", [(3, "num_attention_heads", 4), (4, "num_key_value_heads", 2),
                                      (8, "num_attention_heads", 4)])
def test_sharding_must_divide(tp, dim, n):
    import torch

    from flare.prepare.parallel import ShardingError, TensorParallel
    from flare.prepare.recipes import by_name
    from flare.prepare.sources import resolve

    config = resolve("llama-tiny").config
    with pytest.raises(ShardingError, match=rf"--tp {tp} does not divide {dim} \({n}\)"):
        by_name("decoder").build(config, torch.float32, tp=TensorParallel(0, tp))


def test_hybrid_sharding_must_divide_the_linear_attention_heads():
    """The hybrid recipes shard each Gated DeltaNet by its heads (test_tensor_parallel_hybrid.py):
    a TP size that does not divide them is refused by name."""
    import torch

    from flare.prepare.parallel import ShardingError, TensorParallel
    from flare.prepare.recipes import by_name
    from flare.prepare.sources import resolve

    config = resolve("qwen3_5-tiny").config
    config.get_text_config().linear_num_key_heads = 3
    with pytest.raises(ShardingError, match=r"--tp 2 does not divide linear_num_key_heads \(3\)"):
        by_name("qwen3_5").build(config, torch.float32, tp=TensorParallel(1, 2))


# ---------------------------------------------------------------------------
# Serving a TP core (these two share one server; the kill test runs last)


@pytest.fixture(scope="module")
def tp2_server(tp2_core):
    # Without the prefix cache: the requests asked alone repeat the concurrent ones, and
    # a restored checkpoint (another prefill partition, ~1e-6 logit differences) could
    # change a token sampled over random weights; batching, not the cache, is tested here.
    with running_server(tp2_core, "--no-prefix-cache") as srv:
        yield srv


def _ask(client: openai.OpenAI, i: int) -> str:
    r = client.chat.completions.create(model="llama-tiny", messages=[{"role": "user", "content": f"question {i}"}],
                                       max_tokens=12, temperature=0.8, seed=100 + i,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    return r.choices[0].message.content


def test_tp2_serves_concurrent_requests(tp2_server):
    """Concurrent requests on the TP=2 core through the official client; each answer is
    the one the same request gets alone (per-request seeds: batching never changes it)."""
    client = openai.OpenAI(base_url=tp2_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: _ask(client, i), range(4)))
    alone = [_ask(client, i) for i in range(4)]
    assert together == alone
    assert len(set(alone)) == 4
    assert scrape_metrics(tp2_server.url)["flare_executor_tp_size"] == 2


def _worker_pids(server_pid: int) -> dict[int, int]:
    """rank -> pid of the server's reference workers (rank is their third argument)."""
    out = {}
    for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"flare.prepare.reference_worker" in argv:
            out[int(argv[argv.index(b"flare.prepare.reference_worker") + 3])] = int(pid)
    return out


def test_killed_rank_stops_every_rank(tp2_server):
    """A rank worker killed mid-request: the request fails with a typed error, every
    rank is stopped, and the server reports not ready (503) instead of hanging."""
    pids = _worker_pids(tp2_server.proc.pid)
    assert sorted(pids) == [0, 1]
    events: list[str] = []

    def stream():
        body = {"model": "llama-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", tp2_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while len(events) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pids[1], 9)
    t.join(timeout=30)
    assert not t.is_alive()
    last = json.loads(events[-1])
    assert last["error"]["code"] == "worker_died", events[-3:]
    assert "[DONE]" not in events
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())  # rank 0 too
    health = httpx.get(tp2_server.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    r = httpx.post(tp2_server.url + "/v1/chat/completions", timeout=5,
                   json={"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
