"""Cascade: lossless hierarchical speculative decoding over a chain of models.

The names below are imported when first used, so that ``import cascade`` (and the CLI's argument errors) does not
load transformers."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["Cascade", "CascadeConfig", "ConfigError", "GenerationResult", "load_config", "__version__"]

_HOMES = {"Cascade": "cascade.api", "GenerationResult": "cascade.api", "CascadeConfig": "cascade.config",
          "ConfigError": "cascade.config", "load_config": "cascade.config"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'cascade' has no attribute {name!r}")
