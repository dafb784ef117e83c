"""Model recipes: how a Transformers architecture becomes prepared programs.

Model identity is decided here and only here; the runtime reads geometry and
behaviour from the manifest.
"""

from __future__ import annotations

from flare.prepare.recipes.base import Recipe, RecipeError
from flare.prepare.recipes.decoder import DecoderRecipe
from flare.prepare.recipes.moe import Qwen3MoeRecipe
from flare.prepare.recipes.qwen3_5 import Qwen35MoeRecipe, Qwen35Recipe, Qwen3NextRecipe

__all__ = ["Recipe", "RecipeError", "UnsupportedArchitecture", "by_name", "for_model_type"]

_RECIPES = {r.name: r for r in (DecoderRecipe(), Qwen35Recipe(), Qwen3MoeRecipe(), Qwen35MoeRecipe(), Qwen3NextRecipe())}


class UnsupportedArchitecture(ValueError):
    pass


def for_model_type(model_type: str) -> Recipe:
    for r in _RECIPES.values():
        if model_type in r.model_types:
            return r
    supported = sorted(t for r in _RECIPES.values() for t in r.model_types)
    raise UnsupportedArchitecture(f"no recipe for model_type {model_type!r} (supported: {', '.join(supported)})")


def by_name(name: str) -> Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        raise UnsupportedArchitecture(f"unknown recipe {name!r}") from None
