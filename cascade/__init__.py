"""Cascade: lossless hierarchical speculative decoding over a chain of models."""

from cascade.api import Cascade, GenerationResult
from cascade.config import CascadeConfig, ConfigError, load_config

__version__ = "0.1.0"
__all__ = ["Cascade", "CascadeConfig", "ConfigError", "GenerationResult", "load_config", "__version__"]
