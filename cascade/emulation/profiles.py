"""Accelerators and model shapes as data, each number with its public source (DESIGN.md, "Emulated accelerators").

A :class:`DeviceProfile` is what the pass-time model (:mod:`cascade.emulation.roofline`) needs of an accelerator: its
memory bandwidth and dense peak, its links, a per-layer launch cost and the fractions of peak that inference kernels
reach. A :class:`ModelShape` is a decoder's public ``config.json`` values; nothing is downloaded.

Datasheet figures are the vendors' (dense, not sparse, peaks). The launch costs, link latencies and efficiencies
are not datasheet figures: they are this project's estimates, stated as such, and what the validation in
``benchmarks/emulation.md`` (``python benchmarks/emulation_validation.py``) measures the model against.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True, slots=True)
class Link:
    """A transfer path between two devices: ``bandwidth`` bytes/s in one direction, ``latency`` seconds a message."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One accelerator. Bandwidths in bytes/s, peaks in FLOP/s, times in seconds."""

    name: str
    memory_bandwidth: float  # HBM, bytes/s
    bf16_flops: float  # dense bf16/fp16 peak
    fp8_flops: float  # dense fp8 peak (0: no fp8 tensor cores; fp8 then runs at the bf16 peak)
    memory_bytes: float  # HBM capacity
    allreduce_bandwidth: float  # one device's aggregate link bandwidth to its peers, one direction (tensor parallelism)
    peer: Link  # device to device on one node (a drafter's rows to its verifier)
    launch_seconds: float  # per decoder layer: its kernels' launch and tail cost (estimate; CUDA/HIP graphs assumed)
    bandwidth_efficiency: float  # share of memory_bandwidth a decode pass's weight and KV streaming reaches (estimate)
    flops_efficiency: float  # share of the dense peak large matrix products reach (estimate)
    source: str

    def peak(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" and self.fp8_flops else self.bf16_flops


# Link latencies: small-message all-reduce and peer copies take ~10-30 µs through NCCL/RCCL (their own tests report
# tens of microseconds at 8 bytes to 1 KB on one node); the figures below are estimates in that range.
DEVICES: dict[str, DeviceProfile] = {
    "mi300x": DeviceProfile(
        "AMD Instinct MI300X", memory_bandwidth=5.3 * TB, bf16_flops=1307.4e12, fp8_flops=2614.9e12,
        memory_bytes=192 * GB,
        # 7 Infinity Fabric links to the other 7 GPUs of an 8-GPU OAM node, 64 GB/s each way per link
        allreduce_bandwidth=7 * 64 * GB, peer=Link("xGMI", 64 * GB, 15e-6),
        launch_seconds=40e-6, bandwidth_efficiency=0.70, flops_efficiency=0.50,
        source="AMD Instinct MI300X data sheet (5.3 TB/s HBM3, 192 GB, 1307.4 TFLOPS bf16 / 2614.9 fp8 dense, "
        "896 GB/s aggregate Infinity Fabric peer bandwidth)",
    ),
    "mi325x": DeviceProfile(
        "AMD Instinct MI325X", memory_bandwidth=6.0 * TB, bf16_flops=1307.4e12, fp8_flops=2614.9e12,
        memory_bytes=256 * GB,
        allreduce_bandwidth=7 * 64 * GB, peer=Link("xGMI", 64 * GB, 15e-6),
        launch_seconds=40e-6, bandwidth_efficiency=0.70, flops_efficiency=0.50,
        source="AMD Instinct MI325X data sheet (6 TB/s HBM3E, 256 GB, 1307.4 TFLOPS bf16 / 2614.9 fp8 dense; "
        "Infinity Fabric as MI300X)",
    ),
    "h100": DeviceProfile(
        "NVIDIA H100 SXM", memory_bandwidth=3.35 * TB, bf16_flops=989.4e12, fp8_flops=1978.9e12,
        memory_bytes=80 * GB,
        # NVLink 4: 900 GB/s total, 450 GB/s each way, through NVSwitch to any peer
        allreduce_bandwidth=450 * GB, peer=Link("NVLink 4", 450 * GB, 10e-6),
        launch_seconds=30e-6, bandwidth_efficiency=0.80, flops_efficiency=0.65,
        source="NVIDIA H100 Tensor Core GPU data sheet, SXM (3.35 TB/s HBM3, 80 GB, 989 TFLOPS bf16 / 1979 fp8 "
        "dense, NVLink 900 GB/s)",
    ),
    "h200": DeviceProfile(
        "NVIDIA H200 SXM", memory_bandwidth=4.8 * TB, bf16_flops=989.4e12, fp8_flops=1978.9e12,
        memory_bytes=141 * GB,
        allreduce_bandwidth=450 * GB, peer=Link("NVLink 4", 450 * GB, 10e-6),
        launch_seconds=30e-6, bandwidth_efficiency=0.80, flops_efficiency=0.65,
        source="NVIDIA H200 Tensor Core GPU data sheet, SXM (4.8 TB/s HBM3e, 141 GB, 989 TFLOPS bf16 / 1979 fp8 "
        "dense, NVLink 900 GB/s)",
    ),
    "a100-80gb": DeviceProfile(
        "NVIDIA A100 80GB SXM", memory_bandwidth=2.039 * TB, bf16_flops=312e12, fp8_flops=0.0,
        memory_bytes=80 * GB,
        # NVLink 3: 600 GB/s total, 300 GB/s each way
        allreduce_bandwidth=300 * GB, peer=Link("NVLink 3", 300 * GB, 10e-6),
        launch_seconds=30e-6, bandwidth_efficiency=0.80, flops_efficiency=0.65,
        source="NVIDIA A100 Tensor Core GPU data sheet, 80GB SXM (2,039 GB/s HBM2e, 312 TFLOPS bf16 dense, no fp8, "
        "NVLink 600 GB/s)",
    ),
    "a100-40gb": DeviceProfile(
        "NVIDIA A100 40GB SXM", memory_bandwidth=1.555 * TB, bf16_flops=312e12, fp8_flops=0.0,
        memory_bytes=40 * GB,
        allreduce_bandwidth=300 * GB, peer=Link("NVLink 3", 300 * GB, 10e-6),
        launch_seconds=30e-6, bandwidth_efficiency=0.80, flops_efficiency=0.65,
        source="NVIDIA A100 Tensor Core GPU data sheet, 40GB SXM (1,555 GB/s HBM2, 312 TFLOPS bf16 dense, no fp8, "
        "NVLink 600 GB/s)",
    ),
}

# Between nodes: one 400 Gb/s NIC per GPU (InfiniBand NDR or RoCE, as MI300X and H100 nodes ship), RDMA latency a
# few microseconds plus the software path (estimate).
NIC = Link("400 Gb/s NIC", 50 * GB, 10e-6)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-style decoder's shape (the public ``config.json``): grouped-query attention, SwiGLU MLP."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2's q/k/v projections have biases

    @property
    def layer_parameters(self) -> int:
        """Weights of one decoder layer: attention projections, MLP, two norms."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return q + kv + bias + o + mlp + 2 * self.hidden

    @property
    def head_parameters(self) -> int:
        """The LM head's weights (the embedding matrix itself when tied)."""
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """Every weight: embeddings, layers, final norm and an untied LM head."""
        untied = 0 if self.tied_embeddings else self.head_parameters
        return self.vocab * self.hidden + self.layers * self.layer_parameters + self.hidden + untied


# Values from each model's config.json on the Hugging Face hub (meta-llama/*, Qwen/*).
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, tied_embeddings=True),
        ModelShape("llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, tied_embeddings=True),
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, tied_embeddings=False),
        ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, tied_embeddings=False),
        ModelShape("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, tied_embeddings=False),
        ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tied_embeddings=True, qkv_bias=True),
        ModelShape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, tied_embeddings=True, qkv_bias=True),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, tied_embeddings=False, qkv_bias=True),
        ModelShape("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, tied_embeddings=False, qkv_bias=True),
        ModelShape("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, tied_embeddings=False, qkv_bias=True),
    )
}

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


def device(name: str) -> DeviceProfile:
    """The profile named ``name``, or a clear error listing those there are."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(DEVICES))}") from None


def model(name: str) -> ModelShape:
    """The model shape named ``name``, or a clear error listing those there are."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
