"""The HIP/CUDA verification kernels in ``kernels/``, compiled on first use for the local GPU.

``torch.utils.cpp_extension`` builds ``kernels/binding.cpp`` + ``kernels/verify_kernels.cu`` with the toolchain
PyTorch was built for: hipcc on a ROCm PyTorch (the architectures from ``PYTORCH_ROCM_ARCH``, else the local
GPU's), nvcc on a CUDA PyTorch. The build is cached under ``$XDG_CACHE_HOME/cascade/kernels`` by a hash of the
sources, so it happens once per source version and machine.
"""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from pathlib import Path

import torch

from cascade.kernels import build_cache, find_kernel_source

log = logging.getLogger("cascade.verify")

_SOURCES = ("binding.cpp", "verify_kernels.cu", "verify_kernels.h", "compat.h")


class NativeUnavailable(RuntimeError):
    """The HIP/CUDA kernels cannot be built or loaded here; the message says why."""


def kernel_dir() -> Path:
    """``kernels/`` of a source checkout, or its copy inside an installed wheel."""
    source = find_kernel_source("verify_kernels.cu")
    if source is None:
        raise NativeUnavailable("the kernel sources are missing (kernels/ of the checkout, or the wheel's copy)")
    return source.parent


def _cache_dir(digest: str) -> Path:
    flavour = f"rocm{torch.version.hip}" if torch.version.hip else f"cuda{torch.version.cuda}"
    return build_cache() / f"{flavour}-torch{torch.__version__}-{digest}"


@lru_cache(maxsize=1)
def load():
    """The compiled extension module (functions ``argmax_rows``, ``greedy_accept``, ``sampling``, ``tree_matching``,
    ``tree_sampling``)."""
    if not torch.cuda.is_available():
        raise NativeUnavailable("no GPU: PyTorch sees neither a CUDA nor a ROCm device")
    from torch.utils import cpp_extension

    if torch.version.hip is None and cpp_extension.CUDA_HOME is None:
        raise NativeUnavailable("no CUDA toolkit found (set CUDA_HOME to a directory with bin/nvcc)")
    if torch.version.hip is not None and cpp_extension.ROCM_HOME is None:
        raise NativeUnavailable("no ROCm toolchain found (set ROCM_HOME to a directory with bin/hipcc)")
    directory = kernel_dir()
    digest = hashlib.sha1(b"".join((directory / name).read_bytes() for name in _SOURCES)).hexdigest()[:12]
    build = _cache_dir(digest)
    build.mkdir(parents=True, exist_ok=True)
    log.info("building the verification kernels in %s (once per source version)", build)
    try:
        return cpp_extension.load(
            name=f"cascade_verify_{digest}",
            sources=[str(directory / "binding.cpp"), str(directory / "verify_kernels.cu")],
            extra_include_paths=[str(directory)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise NativeUnavailable(f"building the verification kernels failed: {e}") from e
