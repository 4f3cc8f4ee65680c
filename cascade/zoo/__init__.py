"""Offline model families: a shared tokenizer and Llama models of increasing size, built from local text."""

from cascade.zoo.build import Family, build_family, default_family_dir, family_status, load_family
from cascade.zoo.presets import PRESETS, Preset, get_preset

__all__ = ["Family", "PRESETS", "Preset", "build_family", "default_family_dir", "family_status", "get_preset", "load_family"]
