"""The CPU attention kernel for ragged batches (``kernels/cpu_attention.cpp``), compiled on first use.

PyTorch's ``scaled_dot_product_attention`` takes a rectangle: in a batch of sequences of different lengths every
one is padded to the longest, and the padding is read and masked. A decode step is bound by reading the keys and
values, so on a CPU a batch of 64 sequences of 50–600 positions spent about two thirds of its attention on padding.
The kernel reads each query row's own positions straight from the slot cache (about 2.9× faster on that batch,
no slower on equal lengths); :class:`cascade.stages.lean.LeanDecoder` runs the short query runs of a step through it
(decodes, drafts to verify) and keeps SDPA for prefill chunks.

The kernel is built with the system's C++ compiler against the installed PyTorch (``-O3 -march=native``, about 10 s)
and cached under ``$XDG_CACHE_HOME/cascade/kernels`` by a hash of its source, the PyTorch version and the CPU, so
it happens once per machine. Concurrent processes (Ray actors starting together) may build at once: each writes
its own file and renames it into place, so no lock can be left behind. Without a compiler the lean forward keeps
SDPA and says so once. ``CASCADE_ATTENTION`` (``auto``, ``kernel``, ``sdpa``) overrides the choice; asking for the
kernel where it cannot run is an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from cascade.kernels import build_cache, find_kernel_source

log = logging.getLogger("cascade.stages.cpu_attention")

ENV_VAR = "CASCADE_ATTENTION"
CHOICES = ("auto", "kernel", "sdpa")
_SOURCE = "cpu_attention.cpp"
_BUILD_TIMEOUT_S = 600
_COMPILE_FLAGS = ("-fPIC", "-std=c++20", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-w")
_LINK_FLAGS = ("-fopenmp", "-lm")  # libm brings libmvec, the vectorised exp


class KernelUnavailable(RuntimeError):
    """The CPU attention kernel cannot be built or loaded here; the message says why."""


def _source() -> Path:
    source = find_kernel_source(_SOURCE)
    if source is None:
        raise KernelUnavailable(f"{_SOURCE} is missing (kernels/ of the checkout, or the wheel's copy)")
    return source


def _cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and flags (the build is not portable across CPUs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted))).encode()


def library_path() -> Path:
    """Where this machine's build of the kernel is (or will be) cached."""
    return _library_path(_source())


def _library_path(source: Path) -> Path:
    recipe = " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode()
    digest = hashlib.sha1(source.read_bytes() + recipe + torch.__version__.encode() + _cpu_identity()).hexdigest()[:16]
    return build_cache() / f"cpu_attention-{digest}.so"


def _build(source: Path, target: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (install g++, or set CXX)")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built, obj = Path(tmp) / target.name, Path(tmp) / "cpu_attention.o"
        # Compiled with -ffast-math (vectorised exp), linked without it: linking with it would add crtfastmath,
        # which turns on flush-to-zero for the whole process when the library loads.
        compile_ = [compiler, "-c", str(source), "-o", str(obj), *_COMPILE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                    *(f"-I{p}" for p in cpp_extension.include_paths())]
        link = [compiler, "-shared", str(obj), "-o", str(built), *_LINK_FLAGS, f"-L{torch_lib}", "-lc10",
                "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        log.info("building the CPU attention kernel (once per machine): %s", target)
        for command in (compile_, link):
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise KernelUnavailable(f"compiling {source.name} failed: {e}") from e
            if result.returncode != 0:
                raise KernelUnavailable(f"compiling {source.name} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same source writes the same bytes


@lru_cache(maxsize=1)
def load() -> None:
    """Build (once per machine) and load the kernel into ``torch.ops.cascade_cpu``; raises KernelUnavailable."""
    source = _source()
    library = _library_path(source)
    if not library.is_file():
        _build(source, library)
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        raise KernelUnavailable(f"loading {library} failed: {e}") from e


def use_kernel(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> bool:
    """Whether a lean forward on ``device`` in ``dtype`` runs its short query runs through the kernel.
    ``CASCADE_ATTENTION`` overrides ``requested``."""
    choice = os.environ.get(ENV_VAR) or requested
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "sdpa":
        return False
    runs_here = device.type == "cpu" and dtype in (torch.float32, torch.float64)
    if choice == "kernel":
        if not runs_here:
            raise RuntimeError(f"the CPU attention kernel runs float32 or float64 on the CPU, not {dtype} on {device}")
        load()
        return True
    if not runs_here:
        return False
    try:
        load()
    except KernelUnavailable as e:
        _warn_once(str(e))
        return False
    return True


@lru_cache(maxsize=1)
def _warn_once(reason: str) -> None:
    log.warning("the CPU attention kernel is unavailable, so attention pads every sequence to the longest: %s",
                reason)


def ragged_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_slot: torch.Tensor, seq_start: torch.Tensor,
    cu_rows: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``query`` [N, heads, head_dim] (contiguous; each sequence's rows together); ``keys``, ``values`` [slots,
    kv_heads, capacity, head_dim]; ``seq_slot``, ``seq_start`` [B] and ``cu_rows`` [B + 1] int64: sequence b's
    rows are ``cu_rows[b] ..``, and its row i is position ``seq_start[b] + i``, attending keys 0 to there.
    Returns [N, heads, head_dim]."""
    load()
    return torch.ops.cascade_cpu.ragged_attention(query, keys, values, seq_slot, seq_start, cu_rows, scale)
