"""Resolve a MODEL argument into a config, a weight stream and frontend assets.

MODEL is one of:
  * a name from ``configs/`` (``smollm2-135m-instruct``),
  * a Hugging Face directory (config.json + *.safetensors + tokenizer.json),
  * a GGUF file.

GGUF files are dequantized by Transformers once and cached as a Hugging Face
directory under the cache dir, keyed by the file's digest, so later
preparations of the same file skip the ~30 s conversion.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from flare.core.sampling_params import NEUTRAL, SAMPLING_NAMES, SAMPLING_PARAMS


class SourceError(ValueError):
    """MODEL cannot be resolved or is not supported."""


@dataclass
class FrontendAssets:
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str]
    eos_ids: tuple[int, ...]
    tokenizer_vocab: int


@dataclass
class ModelSource:
    name: str
    config: Any  # transformers.PretrainedConfig
    frontend: FrontendAssets
    sampling: dict[str, Any]
    ranges: dict[str, tuple[float, float]]
    sampling_source: str
    tool_parser: str
    reasoning_parser: str
    # Called with (param_name -> destination tensor); fills every destination.
    load_weights: Callable[[dict[str, Any]], None]
    random_seed: int | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def configs_dir() -> Path:
    env = os.environ.get("FLARE_CONFIGS")
    if env:
        return Path(env)
    # src/flare/prepare/sources.py -> repository root / configs
    return Path(__file__).resolve().parents[3] / "configs"


def cache_dir() -> Path:
    return Path(os.environ.get("FLARE_CACHE_DIR", Path.home() / ".cache" / "flare"))


def list_configs() -> list[str]:
    d = configs_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def resolve(model: str, *, progress: Callable[[str], None] = lambda s: None) -> ModelSource:
    path = Path(model)
    if path.is_dir():
        return _from_hf_dir(path, name=path.name, spec={}, progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        return _from_hf_dir(_convert_gguf(path, progress), name=path.stem, spec={}, progress=progress)
    cfg = configs_dir() / f"{model}.toml"
    if not cfg.is_file():
        raise SourceError(
            f"unknown model {model!r}: not a directory, not a .gguf file, and not a config in {configs_dir()} "
            f"(known: {', '.join(list_configs()) or 'none'})"
        )
    spec = tomllib.loads(cfg.read_text())
    src = spec.get("source", {})
    kind = src.get("kind")
    if kind == "gguf-package":
        gguf = _package_file(src["package"], src["file"])
        return _from_hf_dir(_convert_gguf(gguf, progress), name=model, spec=spec, progress=progress)
    if kind == "hf-dir":
        return _from_hf_dir(Path(src["path"]).expanduser(), name=model, spec=spec, progress=progress)
    if kind == "random":
        return _random(model, spec, progress)
    raise SourceError(f"config {cfg} has unknown source kind {kind!r}")


def _package_file(package: str, file: str) -> Path:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError as e:
        raise SourceError(f"package {package!r} is not installed (pip install --no-deps {package})") from e
    for f in dist.files or ():
        if Path(str(f)).name == file:
            return Path(str(dist.locate_file(f)))
    raise SourceError(f"package {package!r} does not contain {file!r}")


def _digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(gguf: Path, progress: Callable[[str], None]) -> Path:
    out = cache_dir() / f"gguf-{_digest_file(gguf)[:20]}"
    if (out / "DONE").is_file():
        progress(f"using converted GGUF cache {out}")
        return out
    progress(f"converting {gguf.name} with Transformers (once; cached in {out})")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied weights are stored once, like save_pretrained does
            continue
        seen.add(t.data_ptr())
        state[name] = t.contiguous()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(str(tmp))
    (tmp / "DONE").write_text(str(gguf))
    tmp.rename(out) if not out.exists() else None
    return out


# The sampling fields of a checkpoint's generation_config.json that become a core's defaults
# (as vLLM reads them; ``do_sample`` is not consulted).
GENERATION_CONFIG_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _sampling_from(spec: dict, generation: dict | None = None
                   ) -> tuple[dict[str, Any], dict[str, tuple[float, float]], str]:
    """(defaults, ranges, source). A named config's [sampling] wins; otherwise a
    checkpoint's generation_config.json sampling fields; otherwise neutral (the model's
    distribution as it is)."""
    sampling = dict(NEUTRAL)
    declared = spec.get("sampling", {})
    ranges_in = declared.get("ranges", {})
    values = {k: v for k, v in declared.items() if k != "ranges"}
    source = "config [sampling]" if values else "neutral"
    if not values and generation:
        values = {k: generation[k] for k in GENERATION_CONFIG_FIELDS if generation.get(k) is not None}
        source = "generation_config.json" if values else source
    for k, v in values.items():
        if k not in SAMPLING_NAMES:
            raise SourceError(f"unknown sampling default {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SourceError(f"sampling default {k} = {v!r} is not a number")
        sampling[k] = v
    ranges = {}
    for k, v in ranges_in.items():
        if k not in SAMPLING_NAMES or len(v) != 2:
            raise SourceError(f"bad sampling range {k!r} = {v!r}")
        ranges[k] = (float(v[0]), float(v[1]))
    if not spec:  # ranges wide enough to be useful
        ranges = {p.name: p.range for p in SAMPLING_PARAMS}
    return sampling, ranges, source


def _frontend_from_tokenizer(tok: Any, config: Any, extra_eos: tuple[int, ...] = ()) -> FrontendAssets:
    special = {k: str(v) for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    eos: list[int] = []

    def add(v: Any) -> None:
        if v is None:
            return
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if int(i) not in eos:
                eos.append(int(i))

    add(tok.eos_token_id)
    add(getattr(config.get_text_config(), "eos_token_id", None))
    for i in extra_eos:
        add(i)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return FrontendAssets(
        tokenizer_json=tok.backend_tokenizer.to_str(),
        chat_template=template,
        special_tokens=special,
        eos_ids=tuple(eos),
        tokenizer_vocab=len(tok),
    )


def _from_hf_dir(path: Path, *, name: str, spec: dict, progress: Callable[[str], None]) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise SourceError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path} has no *.safetensors weights")
    config = AutoConfig.from_pretrained(str(path))
    progress(f"loading tokenizer from {path}")
    tok = AutoTokenizer.from_pretrained(str(path))
    gen_eos: tuple[int, ...] = ()
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    v = generation.get("eos_token_id")
    gen_eos = tuple(v) if isinstance(v, list) else ((v,) if isinstance(v, int) else ())
    frontend = _frontend_from_tokenizer(tok, config, gen_eos)
    sampling, ranges, sampling_source = _sampling_from(spec, generation)
    fe = spec.get("frontend", {})

    def load_weights(dest: dict[str, Any]) -> None:
        from safetensors import safe_open

        remaining = set(dest)
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    if key not in dest:
                        continue
                    t = sf.get_tensor(key)
                    d = dest[key]
                    if tuple(t.shape) != tuple(d.shape):
                        raise SourceError(f"weight {key} has shape {tuple(t.shape)}, model expects {tuple(d.shape)}")
                    d.copy_(t)
                    remaining.discard(key)
        if remaining:
            raise SourceError(f"checkpoint lacks weights: {sorted(remaining)[:8]}")

    return ModelSource(
        name=name,
        config=config,
        frontend=frontend,
        sampling=sampling,
        ranges=ranges,
        sampling_source=sampling_source,
        tool_parser=fe.get("tool_parser", "none"),
        reasoning_parser=fe.get("reasoning_parser", "none"),
        load_weights=load_weights,
        description=spec.get("description", str(path)),
    )


def _random(name: str, spec: dict, progress: Callable[[str], None]) -> ModelSource:
    from transformers import AutoConfig

    src = spec["source"]
    model_cfg = dict(spec.get("model", {}))
    model_type = model_cfg.pop("model_type", None)
    if model_type is None:
        raise SourceError(f"config {name!r} declares no model.model_type")
    config = AutoConfig.for_model(model_type, **model_cfg)
    if "tokenizer_dir" in src:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(configs_dir() / src["tokenizer_dir"]))
        frontend = _frontend_from_tokenizer(tok, config)
    elif "tokenizer_from" in src:
        frontend = resolve(src["tokenizer_from"], progress=progress).frontend
    else:
        raise SourceError(f"random config {name!r} must name tokenizer_dir or tokenizer_from")
    seed = int(src.get("seed", 0))
    sampling, ranges, sampling_source = _sampling_from(spec)
    fe = spec.get("frontend", {})

    def load_weights(dest: dict[str, Any]) -> None:
        fill_random(dest, seed=seed, std=float(getattr(config.get_text_config(), "initializer_range", 0.02)))

    return ModelSource(
        name=name,
        config=config,
        frontend=frontend,
        sampling=sampling,
        ranges=ranges,
        sampling_source=sampling_source,
        tool_parser=fe.get("tool_parser", "none"),
        reasoning_parser=fe.get("reasoning_parser", "none"),
        load_weights=load_weights,
        random_seed=seed,
        description=spec.get("description", name),
    )


def fill_random(dest: dict[str, Any], *, seed: int, std: float) -> None:
    """Deterministic random weights written straight into their destinations (on the
    target device), one generator per tensor so the result does not depend on order.
    Norm weights (1-D tensors named *norm*) are ones, as in Transformers' init."""
    import torch

    for i, (name, d) in enumerate(sorted(dest.items())):
        if d.dim() == 1 and "norm" in name:
            d.fill_(1.0)
            continue
        if d.dim() == 1:  # biases
            d.zero_()
            continue
        g = torch.Generator(device=d.device)
        g.manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        tmp = torch.empty(d.shape, dtype=torch.float32, device=d.device)
        tmp.normal_(0.0, std, generator=g)
        d.copy_(tmp)
        del tmp
