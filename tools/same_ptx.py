"""Does the paged-attention kernel compile for sm_90 to the same PTX as at another revision,
with given constexprs? (Triton's compiler and its ptxas; no GPU needed.)

    .venv/bin/python tools/same_ptx.py 492ada7

Compiles ``_attend_kernel`` of ``src/flare/prepare/kernels/paged_attention.py`` at REV and in
the working tree with the constexprs of ``--off NAME=VALUE`` (default ``FULL_BLOCKS=False``:
every key block masked, as every launch of cores before 2026-12-06; since then their prompt
launches take ``FULL_BLOCKS=True``; a constexpr a revision's kernel lacks is left out for it),
at nine launch shapes: head dims 64 (GQA 3), 128 and 256 (GQA 4), each as a decode launch, a
prompt launch with splits and one without. Debug line labels and comments are dropped before
comparing. Exit status 1 if any differ.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flare.prepare.kernels.sm90 import ATTEND_TYPES, compile_for_sm90  # noqa: E402

PATH = "src/flare/prepare/kernels/paged_attention.py"


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def ptx(fn, constexprs: dict) -> list[str]:
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}  # (those this revision has)
    text = compile_for_sm90(fn, ATTEND_TYPES, constexprs, num_warps=4, num_stages=2).asm["ptx"]
    text = text.split(".section\t.debug")[0]
    return [line.split("//")[0].rstrip() for line in text.splitlines()
            if not line.strip().startswith("//") and ".file" not in line and ".loc" not in line
            and not re.match(r"^\$L__(tmp|func)\w*:$", line.strip())]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev")
    p.add_argument("--off", action="append", default=None, help="NAME=VALUE of a new constexpr (Python literal)")
    args = p.parse_args()
    off = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in (args.off or ["FULL_BLOCKS=False"]))}
    old_src = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:{PATH}"], check=True, capture_output=True,
                             text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old_paged_attention.py").write_text(old_src)
        old = _module(Path(tmp) / "old_paged_attention.py", "old_paged_attention")
        new = _module(ROOT / PATH, "new_paged_attention")
        same = True
        for d, bn, group in ((64, 64, 3), (128, 64, 4), (256, 32, 4)):
            heads = 1 << (group - 1).bit_length()
            for block_t, hh, splits, seg, nseg, rtiles in ((1, 16, 32, 0, 0, 0), (64 // heads, heads, 32, 16, 128, 3),
                                                            (64 // heads, heads, 1, 16, 128, 1)):
                c = dict(GROUP=group, HEADS=hh, BLOCK_T=block_t, PAGE=16, D=d, D_PAD=max(16, 1 << (d - 1).bit_length()),
                         BLOCK_N=bn, SPLITS=splits, PRECISION="tf32", TILES_PAD=16, TARGET=264, SEG=seg, NSEG=nseg,
                         RTILES=rtiles)
                eq = ptx(old._attend_kernel, {**c, **off}) == ptx(new._attend_kernel, {**c, **off})
                same &= eq
                print(f"head dim {d}, GQA {group}, {'decode' if block_t == 1 else 'prompt'}, splits {splits}: "
                      f"{'same PTX' if eq else 'DIFFERENT PTX'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
