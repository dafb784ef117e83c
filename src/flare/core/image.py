"""The arena image: persistent buffers stored as a safetensors file.

One tensor per weight buffer, named like the buffer, raw bytes. Written
streaming (one buffer at a time) and read without any tensor library: the
loader only needs byte ranges, so dtype never matters to it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from flare.core.errors import ManifestError
from flare.core.manifest import Buffer, BufferRole, DType, Manifest

_ST_DTYPE = {
    DType.float32: "F32",
    DType.float16: "F16",
    DType.bfloat16: "BF16",
    DType.int32: "I32",
    DType.int64: "I64",
    DType.uint8: "U8",
}


PERSISTENT_ROLES = (BufferRole.weight, BufferRole.scratch)


def persistent_buffers(m: Manifest) -> list[Buffer]:
    return [b for b in m.buffers if b.role in PERSISTENT_ROLES]


def write_image(
    path: Path, buffers: list[Buffer], read_bytes: Callable[[Buffer], bytes | memoryview]
) -> str:
    """Write ``buffers`` (bytes obtained one at a time) and return the sha256 of the data."""
    header: dict = {}
    cursor = 0
    for b in buffers:
        header[b.name] = {"dtype": _ST_DTYPE[b.dtype], "shape": list(b.shape), "data_offsets": [cursor, cursor + b.nbytes]}
        cursor += b.nbytes
    header["__metadata__"] = {"format": "flare-arena-image"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in buffers:
            data = read_bytes(b)
            if len(data) != b.nbytes:
                raise ValueError(f"buffer {b.name}: got {len(data)} bytes, expected {b.nbytes}")
            digest.update(data)
            f.write(data)
    return digest.hexdigest()


def read_header(f: BinaryIO) -> tuple[dict, int]:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > 1 << 28:
        raise ManifestError("arena image header is implausibly large")
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_image(path: Path, m: Manifest) -> Iterable[tuple[Buffer, int, int]]:
    """Yield ``(buffer, file_offset, nbytes)`` for every persistent buffer, after
    checking that the image holds exactly the manifest's persistent buffers."""
    expected = {b.name: b for b in persistent_buffers(m)}
    try:
        with path.open("rb") as f:
            header, base = read_header(f)
    except (OSError, ValueError, struct.error) as e:
        raise ManifestError(f"cannot read arena image {path}: {e}", param="arena.image") from e
    if set(header) != set(expected):
        missing = sorted(set(expected) - set(header))[:5]
        extra = sorted(set(header) - set(expected))[:5]
        raise ManifestError(f"arena image does not match the manifest (missing {missing}, unexpected {extra})",
                            param="arena.image")
    for name, b in expected.items():
        start, end = header[name]["data_offsets"]
        if end - start != b.nbytes or header[name]["dtype"] != _ST_DTYPE[b.dtype]:
            raise ManifestError(f"arena image entry {name!r} does not match its buffer", param=name)
        yield b, base + start, b.nbytes
