"""A CUDA core that this process cannot honour fails to load with a typed error."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from cuda.bindings import driver as d

from flare.core.errors import CoreCompatibilityError
from flare.core.manifest import ABI_VERSION, load_manifest
from flare.runtime.cuda_driver import ck, granularity, open_device
from flare.runtime.cuda_executor import CudaExecutor
from tests.gpu.conftest import gpu_core


def _edited(core, tmp_path, edit):
    dst = tmp_path / "core"
    shutil.copytree(core, dst, symlinks=True)
    raw = json.loads((dst / "manifest.json").read_text())
    edit(raw)
    (dst / "manifest.json").write_text(json.dumps(raw))
    return dst


def test_other_compute_capability_is_rejected(tmp_path):
    core = _edited(gpu_core("smollm2-135m-shape"), tmp_path, lambda r: r["identity"].update(compute_capability="8.0"))
    ex = CudaExecutor(core, load_manifest(core))
    with pytest.raises(CoreCompatibilityError) as e:
        asyncio.run(ex.start())
    assert e.value.code == "compute_capability_mismatch"


def test_other_abi_is_rejected(tmp_path):
    core = _edited(gpu_core("smollm2-135m-shape"), tmp_path, lambda r: r.update(abi=ABI_VERSION + 1))
    with pytest.raises(CoreCompatibilityError) as e:
        load_manifest(core)
    assert e.value.code == "abi_mismatch"


def test_unavailable_address_range_is_rejected():
    core = gpu_core("smollm2-135m-shape")
    m = load_manifest(core)
    open_device(0)
    size = (m.arena.nbytes + granularity() - 1) // granularity() * granularity()
    held = ck(d.cuMemAddressReserve(size, 0, d.CUdeviceptr(m.arena.base_address), 0), "reserve")
    try:
        assert int(held) == m.arena.base_address
        with pytest.raises(CoreCompatibilityError) as e:
            asyncio.run(CudaExecutor(core, m).start())
        assert e.value.code == "address_range_unavailable"
    finally:
        d.cuMemAddressFree(held, size)
