"""How long one batched forward pass of a model takes on an accelerator: a roofline, as pure functions.

For a pass over ``B`` rows, row ``b`` feeding ``T_b`` new tokens after ``L_b`` cached ones and asking for logits at
``N_b`` positions, on ``g`` devices of a profile (:class:`~cascade.emulation.profiles.DeviceProfile`), weights in
dtype ``w`` bytes (KV cache too):

    bytes = w · (layers · P_layer + V · d)                  every layer's weights and the LM head, read once a pass
          + Σ_b KV · (L_b + T_b)                             each row's cache read (L_b) and written (T_b)
    flops = 2 · layers · P_layer · Σ_b T_b + 2 · V · d · Σ_b N_b     the matrix products (the head only where asked)
          + 4 · layers · h · hd · Σ_b T_b · (L_b + (T_b + 1) / 2)    attention: QKᵀ and PV over the causal context
    t     = layers · ℓ + max(bytes / (g · η_bw · BW), flops / (g · η_f · F))
          + [g > 1] · 2 · layers · (λ + 2 (g − 1)/g · Σ_b T_b · d · 2 / BW_link)   two ring all-reduces a layer

with ``KV = 2 · layers · kv_heads · hd · w`` bytes a token. Tensor parallelism splits weights, cache and flops over
the ``g`` devices and adds the all-reduces. A transfer between devices (a drafter's rows to its verifier) takes
``λ + bytes / BW`` over the link. DESIGN.md, "Emulated accelerators", states the same model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cascade.emulation.profiles import DTYPE_BYTES, DeviceProfile, Link, ModelShape


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a batched pass: ``new`` tokens fed after ``cached`` ones, logits asked at ``logits`` positions."""

    new: float
    cached: float
    logits: float = 1.0


@dataclass(frozen=True, slots=True)
class PassCost:
    """What one pass moves and computes, and how long it takes (seconds)."""

    bytes: float
    flops: float
    seconds: float
    bound: str  # "memory" or "compute": which side of the roofline the pass sits on


def kv_bytes_per_token(shape: ModelShape, dtype: str = "bf16") -> float:
    """Keys and values of one token, every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def weight_bytes(shape: ModelShape, dtype: str = "bf16") -> float:
    """What a pass reads of the weights: every layer and the LM head (the embedding rows it gathers are few)."""
    return (shape.layers * shape.layer_parameters + shape.head_parameters) * DTYPE_BYTES[dtype]


def pass_cost(
    shape: ModelShape, device: DeviceProfile, rows: Sequence[Row], *, gpus: int = 1, dtype: str = "bf16"
) -> PassCost:
    """The roofline of one batched pass (the module docstring's formula)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if not rows:
        return PassCost(0.0, 0.0, 0.0, "memory")
    new = sum(r.new for r in rows)
    kv = kv_bytes_per_token(shape, dtype)
    moved = weight_bytes(shape, dtype) + kv * sum(r.cached + r.new for r in rows)
    attention = 4 * shape.layers * shape.heads * shape.head_dim * sum(r.new * (r.cached + (r.new + 1) / 2) for r in rows)
    flops = 2 * shape.layers * shape.layer_parameters * new + 2 * shape.head_parameters * sum(r.logits for r in rows)
    flops += attention
    memory = moved / (gpus * device.bandwidth_efficiency * device.memory_bandwidth)
    compute = flops / (gpus * device.flops_efficiency * device.peak(dtype))
    seconds = shape.layers * device.launch_seconds + max(memory, compute)
    if gpus > 1:
        ring = 2 * (gpus - 1) / gpus * new * shape.hidden * 2  # bf16 activations, each all-reduce
        seconds += 2 * shape.layers * (device.peer.latency + ring / device.allreduce_bandwidth)
    return PassCost(moved, flops, seconds, "memory" if memory >= compute else "compute")


def pass_seconds(
    shape: ModelShape, device: DeviceProfile, rows: Sequence[Row], *, gpus: int = 1, dtype: str = "bf16"
) -> float:
    """Seconds of one batched pass: :func:`pass_cost` ``.seconds``."""
    return pass_cost(shape, device, rows, gpus=gpus, dtype=dtype).seconds


def uniform_rows(batch: int, tokens: float, context: float) -> list[Row]:
    """``batch`` alike rows: ``tokens`` new each after ``context`` cached, logits at every new position."""
    return [Row(tokens, context, tokens)] * batch


def transfer_seconds(nbytes: float, link: Link) -> float:
    """One message of ``nbytes`` over ``link``: its latency, then its bytes at the link's bandwidth."""
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0
