"""``cascade bench --serve``: serving throughput and latency under concurrency, side by side in one run.

For each system — Cascade (the config as given) and the target alone (the same target in the same server, one
stage: plain batched decoding) — a ``cascade serve`` process is started on loopback, and for each temperature and
each concurrency level C, C streaming clients keep sending completions of held-out prompts (``ignore_eos``: every
completion is ``max_tokens`` long) until ``requests`` have completed or ``seconds`` have passed (emulated seconds
under an emulated config); the systems take
turns within each level (:func:`interleaved_levels`). ``--against`` adds a second config of the same target as a
third system, ``against``, served and measured the same way (the same config with draft trees off, say): the table
then gives Cascade's rate over it, both sides from the same turns. The external anchor is transformers' own batched ``generate``
of the target (left padding, batch = C). At one client the Python API's speed-up of Cascade over the target alone is
measured on the same prompts, its engines taking turns with the servers in that level's slices, so the cost of
serving shows as the gap between the two speed-ups (when the engines ran minutes before the servers started, the two
read up to 20% apart on a shared machine where a level moves by ±10% between runs). Without a level of one client
there is no Python API speed-up to report.

Reported per row: output tokens/s (all clients together), time to first token and the time per output token
after the first (TPOT: ``(latency − TTFT) / (tokens − 1)`` per request), p50 and p95 over requests.
The clients and the turns they take are :mod:`cascade.bench.load`'s.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from cascade.api import Cascade
from cascade.bench.emulated import (
    controller_figures,
    decisions_table,
    emulation_figures,
    increase,
    mean_context,
    planner_prediction,
    scrape,
)
from cascade.bench.load import ServeOptions, interleaved_levels, load_level, on_the_wall, percentile
from cascade.bench.prompts import file_prompts, held_out_prompts
from cascade.config import CascadeConfig, load_config, packaged_config_path
from cascade.server.launch import running_servers


@dataclass(slots=True)
class LevelResult:
    system: str  # "cascade", "target" (alone, in the same server), "against" (--against) or "transformers"
    # (batched generate)
    temperature: float
    concurrency: int
    requests: int
    errors: int
    wall_seconds: float
    tokens_per_second: float
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    gap_p95: float | None = None  # p95 of the time between consecutive streamed chunks (stalls show here)
    sustained_tokens_per_second: float | None = None  # the rate with every client's request in flight (sustained_rate)
    emulation: dict | None = None  # emulated stages: real-compute shares, host time, controller, planner (bench.emulated)


@dataclass(slots=True)
class ServeReport:
    rows: list[LevelResult]
    api_speedup: dict[str, float] = field(default_factory=dict)  # temperature -> Python API speed-up at 1 client
    table: str = ""
    files: list[Path] = field(default_factory=list)


def summarize_level(system: str, temperature: float, concurrency: int, level: dict, scale: float = 1.0) -> LevelResult:
    """A level's row; with emulated stages every time is the clients' wall time over the ``scale`` (emulated
    seconds)."""
    ok = [r for r in level["results"] if r["status"] == 200]
    ttfts = [r["ttft"] / scale for r in ok if r["ttft"] is not None]
    tpots = [r["tpot"] / scale for r in ok if r["tpot"] is not None]
    gaps = [g / scale for r in ok for g in r["gaps"]]
    wall = level["wall"] / scale
    return LevelResult(
        system, temperature, concurrency, len(level["results"]), len(level["results"]) - len(ok),
        round(wall, 3), round(sum(r["tokens"] for r in ok) / wall, 1),
        _round(percentile(ttfts, 0.5)), _round(percentile(ttfts, 0.95)),
        _round(percentile(tpots, 0.5)), _round(percentile(tpots, 0.95)), _round(percentile(gaps, 0.95)),
        sustained_rate(ok, concurrency, scale),
    )


def sustained_rate(ok: list[dict], concurrency: int, scale: float = 1.0) -> float | None:
    """The rate ``C`` clients would sustain with a request always in flight, each request taking as long as it
    took here: by Little's law (requests in flight = arrival rate × time in the system), ``C · tokens / request
    seconds`` summed over the level's requests. A level's slices open with a burst of prompts and end in a drain
    (the last clients' requests finishing while the others idle); a system whose requests commit different numbers
    of tokens a step (speculation) drains over many steps of a shrinking batch, which the whole level's rate counts
    and a served load with clients always arriving does not. Each request's time still holds its prefill and the
    prefills it waited behind, as it would with arrivals spread out. None without a finished request."""
    seconds = sum(r["seconds"] for r in ok) / scale
    return round(concurrency * sum(r["tokens"] for r in ok) / seconds, 1) if seconds > 0 else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- the anchors ---------------------------------------------------------------------------------------------


MIN_ANCHOR_PROMPTS = 16  # at one client, 4 prompts (the first of the cycle) read transformers at 212-428 tokens/s
# in three runs against the target alone's 324-377 over 128 requests; prompt lengths differ by 40x here


def anchor_prompts(batch: int) -> int:
    """The prompts transformers' ``generate`` runs at a batch size: two batches, and at least ``MIN_ANCHOR_PROMPTS``."""
    return max(2 * batch, MIN_ANCHOR_PROMPTS)


@torch.inference_mode()
def transformers_batched(model, tokenizer, prompts: list[str], batch: int, temperature: float, max_tokens: int) -> float:
    """Output tokens/s of transformers' ``generate`` over :func:`anchor_prompts` prompts, ``batch`` at a time,
    left-padded, every sequence generating exactly ``max_tokens``."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                             "top_k": 0, "top_p": 1.0}
    count = anchor_prompts(batch)
    chosen = [prompts[i % len(prompts)] for i in range(count)]
    generated, started = 0, time.perf_counter()
    for i in range(0, count, batch):
        encoded = tokenizer(chosen[i : i + batch], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(**encoded, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **sampling)
        generated += (out.shape[1] - encoded["input_ids"].shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - started)


# ---- the run ---------------------------------------------------------------------------------------------------


def without_prefix_reuse(config: CascadeConfig) -> CascadeConfig:
    """The same config with ``batching.reuse_prefixes`` off. The bench's prompts repeat (a few dozen held-out
    prompts cycle through hundreds of requests), and where their number equals a level's concurrency the slot a
    finished request leaves holds exactly the prompt of the next one: at 64 clients the target alone then prefilled
    a fifth of its prompt tokens and ran 1.7× as fast, a measure of the cycle, not of batching or speculation."""
    data = config.model_dump()
    data["batching"]["reuse_prefixes"] = False
    return CascadeConfig.model_validate(data)


def target_alone(config: CascadeConfig) -> CascadeConfig:
    """The same target, batching and runtime, with no drafting stage."""
    data = config.model_dump()
    data["stages"] = [config.target.model_dump()]
    data["served_model_name"] = f"{config.served_model_name}-target"
    data["controller"] = {"mode": "fixed"}
    return CascadeConfig.model_validate(data)


WARMUP_REQUESTS = 8  # per system and temperature, one at a time, before anything is measured: the controller's
# first decisions (its warm-up rounds, every chain tried once) are the same cost through either path


def run_serving(config: str | Path | CascadeConfig | None, options: ServeOptions, progress=print) -> ServeReport:
    if config is None:
        config = packaged_config_path("demo")
    if not isinstance(config, CascadeConfig):
        config = load_config(config)
    _check(options)
    config = with_time_scale(config, options.time_scale)
    prompts = file_prompts(options.prompts_file) if options.prompts_file else held_out_prompts(options.num_prompts, seed=1)
    config = without_prefix_reuse(config)
    systems = {"cascade": config, "target": target_alone(config)}
    if options.against:
        systems["against"] = without_prefix_reuse(against_config(config, options.against, options.time_scale))
    report = ServeReport(rows=[])
    if config.emulated:  # the anchor and the Python API would time the demo models on this CPU, not the devices
        progress(f"emulated stages (time scale {config.time_scale:g}): every figure is in emulated seconds; no "
                 "transformers anchor and no Python API turns")
        _measure_servers(systems, {}, prompts, options, report, progress)
        report.table = serving_table(report)
        if options.out:
            report.files = _write(Path(options.out), report, config, options)
        return report
    # The transformers anchor first, on the Python API engines' target; the engines, warmed up as each server is
    # below, then take turns with the servers at one client.
    engines = {name: Cascade.from_config(systems[name], progress=False) for name in ("cascade", "target")}
    for engine in engines.values():  # the warm-up each server gets
        for t in options.temperatures:
            for prompt in prompts[-WARMUP_REQUESTS:]:
                engine.generate(prompt, max_tokens=options.max_tokens, temperature=t, ignore_eos=True)
    _measure_anchor(engines["target"], prompts, options, report, progress)
    _measure_servers(systems, engines, prompts, options, report, progress)
    del engines
    report.table = serving_table(report)
    if options.out:
        report.files = _write(Path(options.out), report, config, options)
    return report


def with_time_scale(config: CascadeConfig, scale: float | None) -> CascadeConfig:
    """``config`` with its emulated stages stretched by ``scale`` (``--time-scale``; None: its own): the smallest
    scale that keeps the real compute under a quarter of the stretched passes differs by load (docs/emulation.md)."""
    if scale is None:
        return config
    if not config.emulated:
        raise ValueError("--time-scale needs a config with emulated stages (`emulate:` on a stage)")
    data = config.model_dump()
    data["emulation"]["time_scale"] = scale
    return CascadeConfig.model_validate(data)


def against_config(config: CascadeConfig, path: str | Path, time_scale: float | None = None) -> CascadeConfig:
    """The ``--against`` config (at ``time_scale``, as the config's), which must serve the same target on the same
    kind of stages (emulated or not, at the same time scale): otherwise a ratio of the two would measure the
    targets."""
    against = with_time_scale(load_config(path), time_scale)
    if (against.emulated, against.time_scale) != (config.emulated, config.time_scale):
        raise ValueError(f"--against {path}: emulated stages and time scale must match the config's")
    same = {"name", "depth", "siblings"}  # what the target does not use
    if against.target.model_dump(exclude=same) != config.target.model_dump(exclude=same):
        raise ValueError(f"--against {path}: its target must be the config's own ({config.target.model}), with the "
                         "same device, dtype, forward and emulation")
    return against


def _check(options: ServeOptions) -> None:
    if any(c < 1 for c in options.concurrency) or options.max_tokens < 2 or options.requests < 1:
        raise ValueError("concurrency levels and --requests must be >= 1, --max-tokens >= 2")
    for name, values in (("--concurrency", options.concurrency), ("--temperatures", options.temperatures)):
        if len(set(values)) < len(values):  # a level is one row of the table and one point of the plot
            raise ValueError(f"{name} lists a value twice ({' '.join(f'{v:g}' for v in values)}); use --requests "
                             "to measure a level longer")


def _measure_anchor(target: Cascade, prompts: list[str], options: ServeOptions, report: ServeReport, progress) -> None:
    """transformers' batched ``generate`` of the target alone's model, at every temperature and level."""
    model, tokenizer = target.engine.target.model, target.tokenizer
    for t in options.temperatures:
        for c in options.concurrency:
            rate = transformers_batched(model, tokenizer, prompts, c, t, options.max_tokens)
            report.rows.append(LevelResult("transformers", t, c, anchor_prompts(c), 0, 0.0, round(rate, 1)))
            progress(f"transformers generate, batch {c}, T={t}: {rate:.0f} tok/s")


def _measure_servers(systems: dict[str, CascadeConfig], engines: dict[str, Cascade], prompts: list[str],
                     options: ServeOptions, report: ServeReport, progress) -> None:
    """A server per system, all started together (each loads its models while the others do), then
    :func:`_measure_levels` (at one client the Python API ``engines`` take turns with them)."""
    with tempfile.TemporaryDirectory(prefix="cascade-serve-bench-") as tmp:
        paths = {name: Path(tmp) / f"{name}.yaml" for name in systems}
        for name, cfg in systems.items():
            paths[name].write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        with running_servers(paths, "--log-level", "warning", "--max-waiting", "4096") as started:
            urls = {name: url for name, (url, _) in started.items()}
            _measure_levels(systems, engines, urls, prompts, options, report, progress)


def _measure_levels(systems: dict[str, CascadeConfig], engines: dict[str, Cascade], urls: dict[str, str],
                    prompts: list[str], options: ServeOptions, report: ServeReport, progress) -> None:
    """Each server warmed up, then every temperature and level, the systems taking turns."""
    first = next(iter(systems.values()))
    scale, emulated = first.time_scale, first.emulated

    def warm_up(name: str) -> None:  # the warm-up the Python API engines got
        warm = ServeOptions(requests=WARMUP_REQUESTS, max_tokens=options.max_tokens)
        for t in options.temperatures:
            asyncio.run(load_level(urls[name], prompts[-WARMUP_REQUESTS:], 1, t, warm))

    # Under emulation a server's passes are mostly waits, so the servers warm up at once: one after the other, each
    # system and temperature up to a minute on the wall (the warm-up's bound), they took minutes of every run.
    with ThreadPoolExecutor(len(urls) if emulated else 1) as pool:
        list(pool.map(warm_up, urls))
    bounded = on_the_wall(options, scale)
    for t in options.temperatures:
        for c in options.concurrency:
            before = {name: scrape(url) for name, url in urls.items()} if scale != 1 else {}
            levels = interleaved_levels(urls, prompts, c, t, bounded, engines if c == 1 else None)
            if c == 1 and engines:
                api = {name: sum(r["tokens"] for r in levels[f"api:{name}"]["results"])
                       / levels[f"api:{name}"]["wall"] for name in engines}
                report.api_speedup[str(t)] = round(api["cascade"] / api["target"], 3)
                progress(f"python API, 1 client, T={t}: cascade {api['cascade']:.0f} tok/s, target alone "
                         f"{api['target']:.0f} tok/s, speed-up {report.api_speedup[str(t)]:.2f}x")
            for name in urls:
                row = summarize_level(name, t, c, levels[name], scale)
                if before:
                    row.emulation = _emulated_level(systems[name], urls[name], before[name], row, levels[name],
                                                    options, scale)
                report.rows.append(row)
                progress(f"{name:>12} T={t} c={c:>3}: {row.tokens_per_second:7.1f} tok/s, TTFT p50 "
                         f"{row.ttft_p50} s, TPOT p50 {row.tpot_p50} s ({row.requests} requests, "
                         f"{row.errors} errors)")


def _emulated_level(config: CascadeConfig, url: str, before: dict, row: LevelResult, level: dict,
                    options: ServeOptions, scale: float) -> dict:
    """The emulated figures of one system's level (:mod:`cascade.bench.emulated`)."""
    after = scrape(url)
    delta = increase(before, after)
    tokens = sum(r["tokens"] for r in level["results"] if r["status"] == 200)
    figures = emulation_figures(delta, scale, tokens, level["wall"])
    figures["controller"] = controller_figures(delta, after, [s.name for s in config.stages])
    context = mean_context(delta, options.max_tokens)
    figures["planner"] = planner_prediction(config, figures["controller"], context, row.concurrency, options.max_tokens)
    figures["mean_context"] = round(context, 1)
    return figures


def _write(out: Path, report: ServeReport, config: CascadeConfig, options: ServeOptions) -> list[Path]:
    """``serve.json`` (the config, the options and every row) and the plot, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "serve.json"
    json_path.write_text(json.dumps({
        "config": config.model_dump(mode="json"), "options": asdict(options),
        "api_speedup_at_1_client": report.api_speedup, "rows": [asdict(r) for r in report.rows],
    }, indent=2))
    return [json_path, *serving_plot(out, report, config.served_model_name)]


def _row(report: ServeReport, system: str, t: float, c: int) -> LevelResult | None:
    return next((r for r in report.rows if r.system == system and r.temperature == t and r.concurrency == c), None)


def serving_table(report: ServeReport) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    against = any(r.system == "against" for r in report.rows)
    lines = [
        "| T | clients | Cascade tok/s | target alone tok/s | transformers generate tok/s | Cascade / target "
        + ("| against tok/s | Cascade / against " if against else "")
        + "| TTFT p50/p95 ms (Cascade, target) | TPOT p50/p95 ms (Cascade, target) |",
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if against else ""),
    ]
    temperatures = sorted({r.temperature for r in report.rows})
    levels = sorted({r.concurrency for r in report.rows})
    for t in temperatures:
        for c in levels:
            cas, tgt, hf = (_row(report, s, t, c) for s in ("cascade", "target", "transformers"))
            if cas is None or tgt is None:
                continue
            ratio = cas.tokens_per_second / tgt.tokens_per_second if tgt.tokens_per_second else float("nan")
            anchor = f"{hf.tokens_per_second:.0f}" if hf else "-"
            other = ""
            if against:
                alt = _row(report, "against", t, c)
                rate = alt.tokens_per_second if alt else 0.0
                other = f"{rate:.0f} | {cas.tokens_per_second / rate:.2f}x | " if rate else "- | - | "
            lines.append(
                f"| {t:g} | {c} | {cas.tokens_per_second:.0f} | {tgt.tokens_per_second:.0f} | {anchor} | "
                f"{ratio:.2f}x | {other}"
                f"{ms(cas.ttft_p50)}/{ms(cas.ttft_p95)}, {ms(tgt.ttft_p50)}/{ms(tgt.ttft_p95)} | "
                f"{ms(cas.tpot_p50)}/{ms(cas.tpot_p95)}, {ms(tgt.tpot_p50)}/{ms(tgt.tpot_p95)} |"
            )
    if any(r.emulation for r in report.rows):
        lines += ["", "Emulated accelerators: rates and latencies above are in emulated seconds (wall / time_scale).",
                  "", decisions_table(report.rows)]
    for t, speedup in report.api_speedup.items():
        http = _row(report, "cascade", float(t), 1), _row(report, "target", float(t), 1)
        if all(http):
            lines.append(
                f"1 client, T={t}: speed-up over HTTP {http[0].tokens_per_second / http[1].tokens_per_second:.2f}x, "
                f"through the Python API {speedup:.2f}x"
            )
    return "\n".join(lines)


def serving_plot(out: Path, report: ServeReport, title: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    temperatures = sorted({r.temperature for r in report.rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
    styles = {"cascade": ("Cascade", "o-"), "against": ("Cascade, --against config", "D-."),
              "target": ("target alone (same server)", "s--"), "transformers": ("transformers generate (batched)", "^:")}
    for ax, t in zip(axes[0], temperatures):
        for system, (label, style) in styles.items():
            rows = sorted((r for r in report.rows if r.system == system and r.temperature == t),
                          key=lambda r: r.concurrency)
            if rows:
                ax.plot([r.concurrency for r in rows], [r.tokens_per_second for r in rows], style, label=label)
        levels = sorted({r.concurrency for r in report.rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients (batch size for transformers)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{title}: {'greedy' if t == 0 else f'T = {t:g}'}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "serve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
