"""``cascade bench``: Cascade side by side with the target alone and with transformers' speculative decoding.

Every figure is a ratio measured in the same run: methods run interleaved on the same prompts after a warm-up,
and each speed-up is this method's throughput over the target's in the same repeat (median over repeats). With a
config whose backend is Ray, every method runs in this process as usual, and the cascades of the whole family
(fixed depths and adaptive) also run with their model stages as Ray actors (``ray:cascade:...``): local against
Ray, side by side. With ``--pipeline`` (or a config with ``runtime.pipeline: true``) the whole family's cascades
also run pipelined (``...~pipelined``), locally and on Ray: synchronous against pipelined, side by side.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from cascade.api import Cascade
from cascade.bench.methods import CascadeMethod, HFMethod, build_methods, cascade_methods
from cascade.bench.prompts import file_prompts, held_out_prompts
from cascade.bench.report import plot, table, write_json
from cascade.bench.runner import BenchResult, MethodSummary, run_benchmark, summarize
from cascade.config import CascadeConfig, load_config, packaged_config_path

__all__ = ["BenchOptions", "BenchReport", "run"]

DEFAULT_DEPTHS = (2, 4, 8)  # 8: the adaptive controller's default bound, so the oracle grid reaches it


@dataclass(frozen=True, slots=True)
class BenchOptions:
    max_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 3
    num_prompts: int = 6
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    methods: tuple[str, ...] = ()  # fnmatch patterns; empty means all
    prompts_file: str | None = None
    out: str | None = "bench-out"
    progress: bool = True
    pipeline: bool = False  # also the whole family's cascades pipelined (implied by runtime.pipeline)

    @staticmethod
    def quick(**overrides) -> BenchOptions:
        """Under two minutes on the demo family: one depth, three prompts, two repeats, short completions."""
        return BenchOptions(**{"max_tokens": 64, "repeats": 2, "num_prompts": 3, "depths": (4,), **overrides})


@dataclass(frozen=True, slots=True)
class BenchReport:
    summaries: list[MethodSummary]
    result: BenchResult
    table: str
    files: list[Path]


def _select(methods, patterns):
    if not patterns:
        return methods
    chosen = [m for m in methods if any(fnmatch.fnmatchcase(m.name, p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(m.name, p) for m in methods)]
    if unknown:
        raise ValueError(f"--methods {unknown} match no method; available: {[m.name for m in methods]}")
    if chosen[0].name != "target":
        chosen.insert(0, methods[0])  # the target alone is the baseline of every ratio
    return chosen


def run(config: str | Path | CascadeConfig | None, options: BenchOptions) -> BenchReport:
    if options.max_tokens < 1 or options.repeats < 1 or options.num_prompts < 1:
        raise ValueError("--max-tokens, --repeats and the number of prompts must be >= 1")
    if any(d < 1 for d in options.depths):
        raise ValueError(f"depths must be >= 1, got {list(options.depths)}")
    if not isinstance(config, CascadeConfig):
        config = load_config(config if config is not None else packaged_config_path("demo"))
    pipeline = options.pipeline or config.runtime.pipeline
    # Every method says for itself whether it is pipelined: the family is loaded synchronous.
    config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"pipeline": False})})
    options = dataclasses.replace(options, pipeline=pipeline)
    local = config.model_copy(update={"runtime": config.runtime.model_copy(update={"backend": "local"})})
    family = Cascade.from_config(local)  # quiet: the bench shows its own progress
    remote = Cascade.from_config(config) if config.runtime.backend == "ray" else None
    try:
        return _run(config, options, family, remote)
    finally:
        if remote is not None:
            remote.close()


def _methods(options: BenchOptions, family: Cascade, remote: Cascade | None) -> list[HFMethod | CascadeMethod]:
    """The methods the options select, on ``family``'s stages (and, with ``remote``, the full cascade on its Ray
    actors as ``ray:``)."""
    stages = {s.name: s for s in family.engine.stages}
    order = [s.name for s in family.engine.stages]
    # The adaptive methods use the config's controller parameters when it has them (else the defaults).
    controller = family.engine.controller.params if family.engine.controller is not None else None
    clock = family.clock  # emulated seconds where the stages are emulated
    methods = build_methods(stages, order, family.tokenizer, list(options.depths), controller, clock)
    if options.pipeline:
        methods += cascade_methods(stages, order, family.tokenizer, list(options.depths), controller, [tuple(order)],
                                   pipeline=True, clock=clock)
    if remote is not None:
        remote_stages = {s.name: s for s in remote.engine.stages}
        for pipeline in (False, True) if options.pipeline else (False,):
            methods += cascade_methods(remote_stages, order, family.tokenizer, list(options.depths), controller,
                                       [tuple(order)], prefix="ray:", pipeline=pipeline, clock=remote.clock)
    return _select(methods, options.methods)


def _run(config: CascadeConfig, options: BenchOptions, family: Cascade, remote: Cascade | None) -> BenchReport:
    methods = _methods(options, family, remote)
    texts = file_prompts(options.prompts_file) if options.prompts_file else held_out_prompts(options.num_prompts)
    prompts = [family.encode(t) for t in texts]
    target = family.engine.target

    def target_logits(context: list[int]) -> torch.Tensor:
        """The target's own next-token logits after ``context`` (a fresh sequence, released afterwards)."""
        seq_id = -1 - len(context)  # an id no engine hands out
        try:
            return target.score([seq_id], [context], [1])[0][0].cpu()
        finally:
            target.release(seq_id)

    result = run_benchmark(
        methods, prompts, max_tokens=options.max_tokens, temperature=options.temperature,
        repeats=options.repeats, progress=options.progress, target_logits=target_logits,
    )
    summaries = summarize(result, [m.name for m in methods], "target", options.repeats)
    report_table = table(summaries, "target")
    files: list[Path] = []
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {
            "config": config.model_dump(mode="json"),
            "max_tokens": options.max_tokens, "temperature": options.temperature, "repeats": options.repeats,
            "depths": list(options.depths), "prompts": texts,
            "methods": {m.name: {"kind": m.kind, **({"chain": list(m.chain), "depth": m.depth} if isinstance(m, CascadeMethod) else {})} for m in methods},
        }
        json_path = out / "bench.json"
        write_json(json_path, settings=settings, summaries=summaries, result=result)
        mode = "greedy" if options.temperature == 0 else f"temperature {options.temperature}"
        files = [json_path, *plot(out, summaries, f"{family.served_model_name}, {mode}, {options.max_tokens} tokens")]
    _report_mismatches(result)
    return BenchReport(summaries, result, report_table, files)


def _report_mismatches(result: BenchResult) -> None:
    """Greedy divergences from the target alone, on stderr: at a near-tie of its logits (numerical), or a bug."""
    failures = [m for m in result.mismatches if m.kind == "failure"]
    numerical = [m for m in result.mismatches if m.kind == "numerical"]
    if numerical:
        print(
            f"\n{len(numerical)} greedy divergence(s) from the target alone began at a near-tie of its logits "
            f"(numerical, not a bug; DESIGN.md, Numerics): "
            + ", ".join(f"{m.method} prompt {m.prompt} at token {m.first_difference} (gap {m.logit_gap:.2g})"
                        for m in numerical[:5]),
            file=sys.stderr,
        )
    if failures:
        print(f"\n!!! {len(failures)} greedy MISMATCH(ES) against the target alone — this is a bug:", file=sys.stderr)
        for m in failures[:10]:
            gap = "" if m.logit_gap is None else f" (the target's logits differ by {m.logit_gap:.3g} there)"
            print(f"!!!   {m.method} prompt {m.prompt} repeat {m.repeat}: first difference at token "
                  f"{m.first_difference}{gap}", file=sys.stderr)
