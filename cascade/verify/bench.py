"""Kernel benchmark: time per call of each available implementation of the verification op, and the bandwidth
it achieves against the minimum bytes the op must move, next to the device's measured copy bandwidth.

Minimum bytes: greedy reads every target row once to take its argmax, ``(num_tokens + batch) x vocab x 4``;
sampling reads, per request, the p row and the q row at the drawn position, ``2 x batch x vocab x 4`` (the accept
tests touch a few scalars; the implementations read both rows twice, once to sum them and once to find the drawn
token, the second time mostly from cache). Every draft has the full depth (the worst case).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import cascade.verify.reference as reference
from cascade.verify.dispatch import triton_available

BATCHES = (1, 16, 256)
DEPTHS = (4, 8)
VOCABS = (32_000, 128_000)


@dataclass(frozen=True, slots=True)
class Row:
    op: str
    batch: int
    depth: int
    vocab: int
    implementation: str
    microseconds: float
    gigabytes_per_second: float
    fraction_of_copy: float


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second of a plain device-to-device copy (read + write) of a large buffer."""
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * 4 / seconds


def implementations(device: torch.device) -> dict[str, tuple[Callable, Callable]]:
    """name -> (greedy(drafts, cu, logits, depth), sampling(drafts, cu, q, p, u, finals, depth))."""
    impls = {
        "reference": (
            lambda d, cu, logits, k: reference.matching(d, cu, logits.argmax(-1), k),
            reference.sampling,
        )
    }
    if triton_available() and device.type == "cuda":  # the interpreter on the CPU is a correctness tool, not timed
        from cascade.verify import triton_kernels

        impls["triton"] = (triton_kernels.matching_from_rows, triton_kernels.sampling)
    if device.type == "cuda":
        from cascade.verify import native

        try:
            module = native.load()
            impls["native"] = (
                lambda d, cu, logits, k: module.greedy_accept(d, cu, module.argmax_rows(logits), k),
                lambda d, cu, q, p, u, f, k: module.sampling(d, cu, q, p, u, f, k),
            )
        except native.NativeUnavailable as e:
            print(f"native kernels unavailable: {e}")
    return impls


def run(
    device: str | None = None,
    batches=BATCHES,
    depths=DEPTHS,
    vocabs=VOCABS,
    repeats: int | None = None,
    progress: Callable[[str], None] = print,
) -> tuple[list[Row], float]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = repeats or (20 if dev.type == "cuda" else 2)
    copy = copy_bandwidth(dev, 1024 if dev.type == "cuda" else 256)
    impls = implementations(dev)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for vocab in vocabs:
        for depth in depths:
            for batch in batches:
                num_tokens = batch * depth
                cu = torch.arange(0, num_tokens + 1, depth, device=dev)
                drafts = torch.randint(0, vocab, (num_tokens,), device=dev, generator=g)
                p = torch.rand(num_tokens + batch, vocab, device=dev, generator=g)
                p /= p.sum(-1, keepdim=True)
                q = torch.rand(num_tokens, vocab, device=dev, generator=g)
                q /= q.sum(-1, keepdim=True)
                u = torch.rand(num_tokens, device=dev, generator=g)
                f = torch.rand(batch, device=dev, generator=g)
                minimum = {"greedy": (num_tokens + batch) * vocab * 4, "sampling": 2 * batch * vocab * 4}
                for name, (greedy, sampling) in impls.items():
                    calls = {
                        "greedy": lambda p=p: greedy(drafts, cu, p, depth),  # (p, q: freed after the loop)
                        "sampling": lambda p=p, q=q: sampling(drafts, cu, q, p, u, f, depth),
                    }
                    for op, fn in calls.items():
                        seconds = _time(fn, dev, repeats)
                        rate = minimum[op] / seconds
                        rows.append(Row(op, batch, depth, vocab, name, seconds * 1e6, rate / 1e9, rate / copy))
                        progress(format_row(rows[-1]))
                del p, q, calls
    return rows, copy


def format_row(r: Row) -> str:
    return (f"{r.op:>8} {r.batch:>5} {r.depth:>5} {r.vocab:>7} {r.implementation:>9} {r.microseconds:>12.1f} "
            f"{r.gigabytes_per_second:>8.1f} {100 * r.fraction_of_copy:>7.1f}%")


HEADER = f"{'op':>8} {'batch':>5} {'depth':>5} {'vocab':>7} {'impl':>9} {'us/call':>12} {'GB/s':>8} {'of copy':>8}"
