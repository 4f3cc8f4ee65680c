"""Loading a stage's model and tokenizer: from a local directory or a Hugging Face hub id, on the device and in the
dtype its config asks for (``auto``: the first GPU and bfloat16 when there is one, else the CPU and float32), and
where each model stage of one process goes when there are several GPUs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but PyTorch sees no GPU (CUDA or ROCm)")
    return resolved


def spread_over_gpus(stages: int, gpus: int) -> list[str]:
    """``device: auto`` for the model stages of one process: one GPU each, the target (last) on the last GPU and
    the drafters on the ones before it; with fewer GPUs than stages the smallest drafters share the first."""
    if gpus <= 1:
        return ["cuda" if gpus else "cpu"] * stages
    return [f"cuda:{max(0, gpus - stages + j)}" for j in range(stages)]


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_tokenizer(name: str, path: str | Path):
    """Stage ``name``'s tokenizer, from its model's directory or hub id (every model stage loads it this way, local
    or behind a Ray actor)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_source(path))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"stage {name!r}: model {str(path)!r} has no loadable tokenizer: {e}") from None


def _source(path: str | Path) -> str:
    """A local directory, or a Hugging Face hub id (``org/name``). Something written as a path (``/…``, ``./…``,
    ``~/…``) that does not exist is reported as such, not in the hub's terms."""
    text = str(path)
    local = Path(text).expanduser()
    if local.exists():
        return str(local)
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"no such directory: {text!r}")
    return text


def load_model(name: str, path: str | Path, *, device: str = "auto", dtype: str = "auto") -> PreTrainedModel:
    """A causal LM from a directory or hub id, on ``device`` in ``dtype`` (``auto``: bf16 on a GPU, else fp32)."""
    torch_device = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(_source(path), dtype=resolve_dtype(dtype, torch_device))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"stage {name!r}: model {e}") from None
    except (OSError, ValueError) as e:  # not on the hub, offline, or not a hub id at all
        raise FileNotFoundError(
            f"stage {name!r}: model {str(path)!r} is not a local directory, and loading it from the Hugging Face hub "
            f"failed: {e}"
        ) from None
    return model.to(torch_device)
