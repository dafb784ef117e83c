"""bench/verify_widths.py's pieces that run without a GPU: the reduced-depth config and the
per-layer fit."""

from __future__ import annotations

import tomllib

import pytest

from bench.verify_widths import ROOT, fit, with_depth


def test_a_reduced_depth_config_keeps_every_other_setting():
    text = (ROOT / "configs" / "llama-3.1-8b-shape.toml").read_text()
    full, short = tomllib.loads(text), tomllib.loads(with_depth(text, 4))
    assert full["model"]["num_hidden_layers"] == 32 and short["model"]["num_hidden_layers"] == 4
    short["model"]["num_hidden_layers"] = 32
    assert short == full


def test_the_fit_separates_the_layers_from_the_rest():
    # 0.5 ms of embedding, head and sampler, 0.25 ms a layer: exact through two depths.
    got = fit({4: 0.5 + 4 * 0.25, 8: 0.5 + 8 * 0.25}, 32)
    assert got["ms_fixed"] == pytest.approx(0.5) and got["ms_per_layer"] == pytest.approx(0.25)
    assert got["ms_full_depth"] == pytest.approx(0.5 + 32 * 0.25)
    for one_depth in ({4: 1.0}, {}):
        with pytest.raises(ValueError):
            fit(one_depth, 32)
