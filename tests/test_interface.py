"""The program interface's layout is the contract of ABI 6: every core on disk was
prepared with it. The runtime and the programs use the same typed rows, so no test
that packs with them could notice a reordering; these literals can."""

from __future__ import annotations

import numpy as np
import pytest

from flare.core import interface as io
from flare.core import manifest as mf
from flare.core.errors import ExecutionError
from flare.core.sampling_params import INTEGER_STATE, SAMPLING_COLUMNS, SAMPLING_NAMES


def test_row_layouts_are_abi_6():
    assert io.AdmitInput._fields == ("slot", "count", "clear", "mode")
    assert io.PrefillInput._fields == ("slot", "count", "sample", "reserved")
    assert io.StateInput._fields == ("slot", "row", "page", "count")
    assert io.Completion._fields == ("slot", "token", "generated", "status")
    assert io.StateCompletion._fields == ("slot", "row", "consumed", "reserved")
    # Speculative decoding's rows (cores prepared with --draft-tokens; absent from the others)
    assert io.VerifyInput._fields == ("slot", "count", "room") and io.VerifyInput.buffer == "in.verify"
    assert io.VerifyCompletion._fields == ("slot", "emitted", "generated", "status")
    assert mf.STATUS_CODES == {"inactive": -1, "running": 0, "stop": 1, "length": 2}
    assert (int(io.AdmitMode.prompt), int(io.AdmitMode.output)) == (0, 1)
    assert (io.AdmitInput.buffer, io.PrefillInput.buffer, io.StateInput.buffer) == ("in.admit", "in.prefill",
                                                                                    "in.state")


def test_sampling_state_columns_are_abi_6():
    assert SAMPLING_NAMES == ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty")
    assert SAMPLING_COLUMNS == ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                "frequency_penalty")
    assert dict(INTEGER_STATE) == {"top_k": "state.top_k"}


def test_runtime_buffer_order_is_abi_6():
    caps = mf.Capacities(context_limit=64, prefill_chunk=64, prefill_capacities=(64,), decode_capacities=(1, 2),
                         slots=2, max_pages_per_slot=4, stop_ids=4, vocab_size=100, sampling_vocab=100,
                         hidden_size=8, snapshot_rows=2)
    assert list(mf.runtime_buffer_shapes(caps)) == [
        "state.len", "state.pending", "state.generated", "state.max_new", "state.done", "state.seed",
        "state.counter", "state.top_k", "state.sampling", "state.stop_ids", "state.page_table", "state.hist",
        "state.mask_on", "state.logprobs_on", "in.tokens", "in.prefill", "in.admit", "in.decode_slots", "in.token_mask", "in.state",
        "out.prefill_completion", "out.state_completion", "out.decode_completion", "out.logits"]


def test_pack_and_unpack():
    assert io.pack(io.PrefillInput(3, 17, 1)).tolist() == [3, 17, 1, 0]
    assert io.pack(io.PrefillInput(3, 17, 1)).dtype == np.int32
    assert io.completion(np.array([2, 99, 5, 1], np.int32)) == io.Completion(2, 99, 5, io.Status.stop)
    with pytest.raises(ExecutionError, match="Completion has 4 fields, got 3 values"):
        io.unpack(io.Completion, [1, 2, 3])
    with pytest.raises(ExecutionError, match="has 4 fields and optionally 1 \\+ 2N"):
        io.completion([1, 2, 3])
    # A record with log-probabilities: 4 fields, the sampled value and 2 of the top values as
    # float32 bits, then the 2 top ids; an even-length block is malformed.
    block = np.array([-0.5, -0.25, -1.5], np.float32).view(np.int32)
    record = np.concatenate([[2, 99, 5, 0], block, [99, 7]]).astype(np.int32)
    assert io.completion(record) == io.Completion(2, 99, 5, io.Status.running)
    assert io.unpack_logprobs(record, 2) == io.TokenLogprobs(-0.5, (99, 7), (-0.25, -1.5))
    with pytest.raises(ExecutionError, match="log-probability"):
        io.completion(record[:-1])
    with pytest.raises(ExecutionError, match="no block of 3"):
        io.unpack_logprobs(record, 3)
    # A verify record with D = 3: 4 fields then 4 token columns, the emitted ones first.
    head, tokens = io.verify_record([5, 2, 11, 0, 40, 41, -1, -1], 3)
    assert head == io.VerifyCompletion(5, 2, 11, io.Status.running) and tokens == [40, 41]
    with pytest.raises(ExecutionError, match="VerifyCompletion has 4 fields, got 7"):
        io.verify_record([5, 2, 11, 0, 40, 41, -1], 3)
    with pytest.raises(ExecutionError, match="emitted 5 of at most 4"):
        io.verify_record([5, 5, 11, 0, 40, 41, 42, 43], 3)
    rows = io.slot_state(pending=7, generated=2, max_new=9, seed=-5, sampling=dict(
        temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3,
        frequency_penalty=0.4), stop_ids=(2, 5), stop_capacity=4, pages=(6, 8), max_pages=3, mask_on=True,
        logprobs=True)
    assert rows["state.sampling"].tolist() == pytest.approx([0.5, 0.9, 0.1, 1.2, 0.3, 0.4])
    assert rows["state.top_k"] == 3 and rows["state.stop_ids"].tolist() == [2, 5, -1, -1]
    assert rows["state.page_table"].tolist() == [6, 8, 0] and rows["state.mask_on"] == 1
    assert rows[io.LOGPROBS_ON] == 1
