"""Where the native kernels' sources are and where their builds are cached: the one rule both builders use (the
HIP/CUDA verification kernels, :mod:`cascade.verify.native`; the CPU attention kernel,
:mod:`cascade.stages.cpu_attention`)."""

from __future__ import annotations

import os
from pathlib import Path


def find_kernel_source(name: str) -> Path | None:
    """``kernels/<name>`` of a source checkout, or its copy inside an installed wheel; None when neither has it."""
    package = Path(__file__).resolve().parent  # kernels/ sits beside the package, or inside a wheel
    for directory in (package.parent / "kernels", package / "kernels_src"):
        if (directory / name).is_file():
            return directory / name
    return None


def build_cache() -> Path:
    """``$XDG_CACHE_HOME/cascade/kernels`` (``~/.cache`` without it): builds keyed by a hash of what they depend
    on, so each happens once per source version and machine."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cascade" / "kernels"
