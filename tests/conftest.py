"""Shared fixtures: tiny random Llama models built in the test, and the `tiny` zoo family."""

from __future__ import annotations

import os

# Under pytest-xdist (the fast loop runs a worker per core: scripts/test.sh), each worker computes on one thread, set
# before torch is imported so that the processes its tests start inherit it: a process of the suite keeps about one
# core busy (its models are tiny), and two workers of one thread each ran the fast loop in 2 m 19 s against 3 m 32 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ray 2.60's `ray start --head` turns token authentication on, and a process reads RAY_AUTH_MODE when it imports
# ray: set it before any test module does, so this process and the servers it starts present the token that Ray
# keeps in ~/.ray/auth_token (tests/test_ray.py starts such a cluster).
os.environ.setdefault("RAY_AUTH_MODE", "token")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run under Triton's interpreter (tests/test_ops.py). Triton reads the switch when it is
# first imported, and transformers imports it as a side effect, so it is set before anything else is imported.
if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM

from cascade.stages.hf import HFStage, choose_forward  # noqa: E402


def random_llama(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    *,
    seed: int,
    eos_token_id: int | None = None,
    init_range: float = 0.3,
    dtype: torch.dtype = torch.float64,
) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama. float64 and a wide init keep argmax ties (which differ between a
    1-token and a k-token forward pass only by rounding) out of the greedy comparisons."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_range,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed_copy(model: LlamaForCausalLM, noise: float, *, seed: int) -> LlamaForCausalLM:
    """A drafter that agrees with ``model`` often but not always: the same weights plus Gaussian noise (any
    architecture: the copy is of the model's own class)."""
    clone = type(model)(model.config).to(next(model.parameters()).dtype).eval()
    clone.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * noise * p.std())
    return clone


def with_random_biases(model, seed: int = 5):
    """Hugging Face initialises biases to zero, where a dropped bias cannot show: make them count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def hf_stage(name: str, model: LlamaForCausalLM, forward: str = "auto") -> HFStage:
    """A model stage as a config would build it: the lean, batched forward (``forward="auto"``) unless ``forward``
    says otherwise."""
    return HFStage(name, model, forward=choose_forward(model, forward))


@pytest.fixture
def cpu_kernel():
    """The CPU attention kernel, built with this machine's compiler; a test that needs it is skipped where it cannot
    be built (and fails under CASCADE_REQUIRE_CXX=1, as in CI)."""
    from cascade.stages import cpu_attention

    try:
        cpu_attention.load()
    except cpu_attention.KernelUnavailable as e:
        if os.environ.get("CASCADE_REQUIRE_CXX") == "1":
            pytest.fail(f"the CPU attention kernel is required here (CASCADE_REQUIRE_CXX=1): {e}")
        pytest.skip(f"the CPU attention kernel cannot be built here (install g++): {e}")


@pytest.fixture(scope="session")
def tiny_family():
    """The `tiny` zoo family, built once (reused from the cache when it is already there)."""
    from cascade.zoo import build_family

    return build_family("tiny", progress=False)


def emulate_stages(data: dict, device: str, time_scale: float) -> dict:
    """A config of the tiny family (``data``, changed in place and returned) with its models emulated on ``device`` as
    a 1B, an 8B and a 70B Llama."""
    stand_ins = iter(["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"])
    for stage in data["stages"]:
        if stage["type"] == "hf":
            stage["emulate"] = {"device": device, "model": next(stand_ins)}
    data["emulation"] = {"time_scale": time_scale}
    return data
