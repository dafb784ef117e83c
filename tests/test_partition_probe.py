"""bench/partition_probe.py on the CPU reference executor: the same partition run again in
another slot (other pages) gives every prompt row and every logit the same bits, and the
report locates differences by prompt position and decode step."""

from __future__ import annotations

import argparse
import asyncio

from bench import partition_probe


def test_probe_reports_partitions_against_the_first(hybrid_core):
    args = argparse.Namespace(core=str(hybrid_core), executor="reference", prompt=153, steps=4, seed=11,
                              partitions=["128,25", "128,25", "60,31,31,31"])
    result = asyncio.run(partition_probe.main(args))
    first, again, other = result["partitions"]
    assert again["rows_differing"] == 0 and again["logits_differing"] == 0 and again["first_row_differing"] is None
    assert again["tokens"] == first["tokens"] and len(first["tokens"]) == 5
    assert other["chunks"] == [60, 31, 31, 31]
    if other["rows_differing"]:
        assert 0 <= other["first_row_differing"] < 153
