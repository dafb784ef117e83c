"""Golden replays: digests of every runtime-owned buffer after each program runs on
deterministic input sets (``flare.runtime.qualify``), recorded by preparation for
the runtime to reproduce bit for bit (``flare.runtime.replay_check``)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flare.core.manifest import Manifest
from flare.runtime import qualify


def set_bytes(views: dict[str, torch.Tensor], name: str, value: np.ndarray) -> None:
    dst = views[name].reshape(-1).view(torch.uint8)
    src = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    if src.numel() != dst.numel():
        raise ValueError(f"{name}: {src.numel()} bytes for a {dst.numel()}-byte buffer")
    dst.copy_(src)


def get_bytes(views: dict[str, torch.Tensor], name: str) -> bytes:
    return views[name].reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def record(manifest: Manifest, views: dict[str, torch.Tensor], run: Callable[[str], None], sets: int) -> dict:
    base = qualify.base_state(manifest)
    golden = {}
    for p in manifest.programs:
        results = []
        for i in range(sets):
            for name, value in base.buffers.items():
                set_bytes(views, name, value)
            for name, value in qualify.input_writes(manifest, p.name, i, base).items():
                set_bytes(views, name, value)
            run(p.name)
            results.append(qualify.digests(manifest, lambda n: get_bytes(views, n)))
        golden[p.name] = results
    return golden
