"""``cascade plan``: a chain's predicted tokens/s and inter-token latency on a device, at each concurrency, before
anyone rents it (:mod:`cascade.emulation.planner`), or the time of one pass (``--pass``)."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from cascade.emulation.planner import NGRAM, per_position_alpha, predict
from cascade.emulation.profiles import DEVICES, MODELS, device, model
from cascade.emulation.roofline import pass_cost, uniform_rows


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--device", default="mi300x", help=f"accelerator: {', '.join(sorted(DEVICES))} (default: mi300x)")
    plan.add_argument("--chain", nargs="+", help="models, smallest first, the target last; 'ngram' may be the "
                      "first, e.g. ngram llama-3.2-1b llama-3.1-8b llama-3.1-70b")
    plan.add_argument("--acceptance", type=float, nargs="+",
                      help="acceptance of each stage's drafts by the next, one per pair of adjacent stages")
    plan.add_argument("--acceptance-from", metavar="SOURCE",
                      help="read the acceptance instead from a running server's /metrics (an http URL on loopback), "
                      "a saved /metrics text file, or a serve.json of `cascade bench --serve` (its last Cascade level)")
    plan.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    plan.add_argument("--context", type=float, default=512, help="tokens of context per request (default: 512)")
    plan.add_argument("--prompt", type=float, default=0, help="prompt tokens each request prefills first (default: 0, "
                      "decoding only); with --output, rates include the prefill")
    plan.add_argument("--output", type=float, default=128, help="tokens each request generates (default: 128)")
    plan.add_argument("--lookup-hits", type=float, default=None,
                      help="under the n-gram shortcut, the share of rounds where the n-gram drafter finds a "
                      "continuation (default: no shortcut)")
    plan.add_argument("--depths", type=int, nargs="+", help="also predict the full chain at these fixed depths")
    plan.add_argument("--max-depth", type=int, default=8)
    plan.add_argument("--gpus", type=int, nargs="+", help="devices per stage (tensor parallelism), or one for --pass")
    plan.add_argument("--pass", dest="pass_model", metavar="MODEL", help="time one pass of MODEL instead")
    plan.add_argument("--batch", type=int, default=1, help="--pass: rows in the pass")
    plan.add_argument("--tokens", type=int, default=1, help="--pass: new tokens per row")
    plan.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp8"], help="--pass: weights dtype")
    plan.add_argument("--list", action="store_true", help="list the device profiles and model shapes")
    plan.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args)
    if args.pass_model:
        return _one_pass(args)
    if not args.chain:
        raise ValueError("give --chain (the models, smallest first), --pass MODEL, or --list")
    for name in args.chain:
        if name != NGRAM:
            model(name)  # an unknown name is reported before anything else
    device(args.device)
    edges = args.acceptance
    if args.acceptance_from:
        edges = read_acceptance(args.acceptance_from, len(args.chain) - 1)
    if edges is None:
        raise ValueError(f"give --acceptance (one rate per pair of adjacent stages: {len(args.chain) - 1}) or "
                         "--acceptance-from")
    gpus = args.gpus if args.gpus else None
    if gpus is not None and len(gpus) != len(args.chain):
        raise ValueError(f"--gpus takes one count per stage ({len(args.chain)}), got {len(gpus)}")
    rows = predict(args.device, args.chain, edges, args.concurrency, context=args.context, max_depth=args.max_depth,
                   depths=args.depths, gpus=gpus, prompt=args.prompt, output=args.output, lookup_hits=args.lookup_hits)
    best = {}
    for r in rows:
        if r.method != "adaptive" and (r.concurrency not in best or r.tokens_per_second > best[r.concurrency].tokens_per_second):
            best[r.concurrency] = r
    if args.json:
        print(json.dumps({"device": args.device, "chain": args.chain, "acceptance": list(edges),
                          "context": args.context, "predictions": [r.to_dict() for r in rows],
                          "best": {str(c): r.to_dict() for c, r in best.items()}}, indent=2))
        return 0
    print(f"{DEVICES[args.device].name}, chain {' -> '.join(args.chain)}, acceptance {', '.join(f'{a:.2f}' for a in edges)},"
          f" context {args.context:g} tokens (predicted by the roofline model; see `cascade plan --help`)")
    print(f"{'clients':>7}  {'method':<58} {'depths':<10} {'tok/s':>9} {'ITL ms':>8}")
    for r in rows:
        mark = " <- best" if best[r.concurrency] is r else ""
        depths = ",".join(map(str, r.depths)) or "-"
        print(f"{r.concurrency:>7}  {r.method:<58} {depths:<10} {r.tokens_per_second:>9.1f} "
              f"{1000 * r.itl_seconds:>8.2f}{mark}")
    return 0


def _list(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"devices": sorted(DEVICES), "models": sorted(MODELS)}))
        return 0
    for name, d in sorted(DEVICES.items()):
        print(f"{name:<10} {d.name}: {d.memory_bandwidth / 1e12:.2f} TB/s, {d.bf16_flops / 1e12:.0f} TFLOPS bf16, "
              f"{d.memory_bytes / 1e9:.0f} GB")
    for name, m in sorted(MODELS.items()):
        print(f"{name:<16} {m.parameters / 1e9:.2f}B parameters, {m.layers} layers, hidden {m.hidden}")
    return 0


def _one_pass(args: argparse.Namespace) -> int:
    gpus = args.gpus[0] if args.gpus else 1
    if args.batch < 1 or args.tokens < 1 or args.context < 0:
        raise ValueError(f"--batch and --tokens must be >= 1 and --context >= 0, got {args.batch}, {args.tokens}, "
                         f"{args.context:g}")
    cost = pass_cost(model(args.pass_model), device(args.device), uniform_rows(args.batch, args.tokens, args.context),
                     gpus=gpus, dtype=args.dtype)
    if args.json:
        print(json.dumps({"seconds": cost.seconds, "bytes": cost.bytes, "flops": cost.flops, "bound": cost.bound}))
    else:
        print(f"{args.pass_model} on {gpus} x {args.device}: {1000 * cost.seconds:.3f} ms ({cost.bound}-bound; "
              f"{cost.bytes / 1e9:.2f} GB moved, {cost.flops / 1e12:.3f} TFLOP)")
    return 0


def read_acceptance(source: str, edges: int) -> list[float]:
    """Per drafting stage, in chain order: its per-position acceptance (:func:`~cascade.emulation.planner.
    per_position_alpha` of its drafts, drafted and accepted tokens), from ``/metrics`` text (a URL or a file) or a
    ``serve.json`` (the controller figures of its last emulated Cascade level)."""
    if source.startswith(("http://", "https://")):
        url = source if source.rstrip("/").endswith("/metrics") else source.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"--acceptance-from: no such file {source!r}")
        text = path.read_text()
    if text.lstrip().startswith("{"):
        rows = [r for r in json.loads(text).get("rows", []) if r.get("system") == "cascade" and r.get("emulation")]
        if not rows:
            raise ValueError(f"--acceptance-from: {source!r} has no Cascade level with emulated figures")
        rates = [v.get("alpha", v["acceptance"]) for v in rows[-1]["emulation"]["controller"].values()]
    else:
        rates = _metrics_acceptance(text)
    if len(rates) != edges or any(r is None for r in rates):
        raise ValueError(f"--acceptance-from: {source!r} gives {len(rates)} drafting stages' acceptance {rates}; the "
                         f"chain has {edges} pairs")
    return rates


def _metrics_acceptance(text: str) -> list[float | None]:
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, dict[str, float]] = {}
    names = {"cascade_spec_decode_num_drafts_total": "drafts", "cascade_spec_decode_num_draft_tokens_total": "drafted",
             "cascade_spec_decode_num_accepted_tokens_total": "accepted"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                counts.setdefault(s.labels["stage"], {})[names[s.name]] = s.value
    return [per_position_alpha(c.get("accepted", 0.0), c.get("drafted", 0.0), c.get("drafts", 0.0))
            for c in counts.values()]
