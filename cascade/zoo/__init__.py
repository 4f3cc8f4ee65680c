"""Offline model families: a shared tokenizer and Llama models of increasing size, built from local text.

The names below are imported when first used: the CLI reads the presets without loading transformers."""

from __future__ import annotations

import importlib

__all__ = ["Family", "PRESETS", "Preset", "build_family", "default_family_dir", "family_status", "get_preset", "load_family"]

_HOMES = {name: "cascade.zoo.build" for name in ("Family", "build_family", "default_family_dir", "family_status",
                                                  "load_family")}
_HOMES |= {name: "cascade.zoo.presets" for name in ("PRESETS", "Preset", "get_preset")}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'cascade.zoo' has no attribute {name!r}")
