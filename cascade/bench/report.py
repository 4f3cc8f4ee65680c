"""Benchmark output: a table on stdout, a JSON file with every raw measurement, and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from cascade.bench.runner import BenchResult, MethodSummary


def environment() -> dict:
    import transformers

    from cascade import __version__

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "cascade": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def table(summaries: Sequence[MethodSummary], baseline: str) -> str:
    width = max([36, *(len(s.method) for s in summaries)])  # the method names line up whatever their length
    lines = [f"{'method':<{width}} {'tok/s':>8} {'(min-max)':>15} {'speed-up':>9} {'(min-max)':>13} {'tok/pass':>8}  "
             "acceptance (mean accepted/draft)"]
    for s in sorted(summaries, key=lambda s: -s.speedup):
        acc = "  ".join(
            f"{n} {v['acceptance_rate']:.2f} ({v['mean_accepted']:.2f})"
            for n, v in s.stages.items()
            if v["acceptance_rate"] is not None
        )
        lo, hi = s.tokens_per_second_spread
        slo, shi = s.speedup_spread
        per_pass = f"{s.tokens_per_target_pass:8.2f}" if s.tokens_per_target_pass is not None else f"{'-':>8}"
        lines.append(
            f"{s.method:<{width}} {s.tokens_per_second:8.1f} {f'({lo:.0f}-{hi:.0f})':>15} {s.speedup:8.2f}x "
            f"{f'({slo:.2f}-{shi:.2f})':>13} {per_pass}  {acc}"
        )
    lines.append(f"speed-up: throughput over {baseline!r}, measured in the same repeat; medians over repeats; "
                 "tok/pass: tokens generated per forward pass of the target")
    return "\n".join(lines)


def write_json(path: Path, *, settings: dict, summaries: Sequence[MethodSummary], result: BenchResult) -> None:
    data = {
        "environment": environment(),
        "settings": settings,
        "summary": [asdict(s) for s in summaries],
        **result.to_dict(),
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def plot(out: Path, summaries: Sequence[MethodSummary], title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    ordered = sorted(summaries, key=lambda s: s.speedup)
    kinds = {"cascade": ("#4c72b0", "Cascade, in this process"), "ray:": ("#dd8452", "Cascade, stages as Ray actors"),
             "": ("#999999", "transformers: the target alone, assisted, prompt lookup")}
    kind_of = [next(k for k in kinds if s.method.startswith(k)) for s in ordered]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(ordered) + 1.8))
    errors = [[s.speedup - s.speedup_spread[0] for s in ordered], [s.speedup_spread[1] - s.speedup for s in ordered]]
    ax.barh([s.method for s in ordered], [s.speedup for s in ordered], xerr=errors,
            color=[kinds[k][0] for k in kind_of])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up over the target alone\n(median, min-max over repeats)")
    shown = [k for k in kinds if k in kind_of]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=kinds[k][0]) for k in shown],
              labels=[kinds[k][1] for k in shown], loc="lower right", fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    speedup_png = out / "speedup.png"
    fig.savefig(speedup_png, dpi=110)
    plt.close(fig)

    cascades = [s for s in summaries if any(v["accepted_by_position"] for v in s.stages.values())]  # that drafted
    best = max(cascades, key=lambda s: s.speedup) if cascades else None
    paths = [speedup_png]
    if best is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, v in best.stages.items():
            if v["accepted_by_position"]:
                positions = range(1, len(v["accepted_by_position"]) + 1)
                ax.plot(positions, v["accepted_by_position"], marker="o", label=f"{name} (rate {v['acceptance_rate']:.2f})")
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of drafts accepted at this position")
        ax.set_ylim(0, 1)
        ax.set_title(f"acceptance by stage and position: {best.method}")
        ax.legend()
        fig.tight_layout()
        acceptance_png = out / "acceptance.png"
        fig.savefig(acceptance_png, dpi=110)
        plt.close(fig)
        paths.append(acceptance_png)
    return paths
