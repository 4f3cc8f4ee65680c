"""The ``cascade`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from cascade.allocator import keep_freed_memory


def _add_zoo(sub: argparse._SubParsersAction) -> None:
    from cascade.zoo.presets import PRESETS

    zoo = sub.add_parser("zoo", help="offline model families").add_subparsers(dest="zoo_command", required=True)
    build = zoo.add_parser("build", help="build (or reuse) a family of models from local text")
    build.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="family size (default: demo)")
    build.add_argument("--out", help="output directory (default: $XDG_CACHE_HOME/cascade/zoo/<preset>)")
    build.add_argument("--corpus", help="a directory or text file to learn from (default: the Python stdlib sources)")
    build.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    build.add_argument("--force", action="store_true", help="rebuild even if a complete family is there")
    build.set_defaults(run=_zoo_build)


def _zoo_build(args: argparse.Namespace) -> int:
    from cascade.zoo import build_family
    from cascade.zoo.build import summary_table

    family = build_family(args.preset, args.out, corpus=args.corpus, seed=args.seed, force=args.force)
    print(summary_table(family))
    print(f"config: {family.config_path}")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate a completion with a cascade")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--config", help="cascade YAML (default: the embedded demo, built on first use)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    from cascade.config import load_config
    from cascade.sampling import SamplingParams

    # Before loading anything (transformers and the models): a bad argument or config is reported at once.
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {args.max_tokens}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {args.seed}")
    config = load_config(args.config) if args.config is not None else None
    from cascade.api import Cascade

    engine = Cascade.from_config(config)  # quiet: weight-loading bars are noise next to the completion
    options = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    if args.json:
        result = engine.generate(args.prompt, **options)
        print(json.dumps(result.to_dict()))
        return 0
    started = time.perf_counter()
    generation = engine.start(args.prompt, **options)
    while not generation.finished:
        for _, delta in engine.step():  # this is the only generation running
            sys.stdout.write(delta)
        sys.stdout.flush()
    result = engine.result(generation)
    seconds = time.perf_counter() - started
    rates = ", ".join(
        f"{s.name} {s.acceptance_rate:.2f}" for s in result.stats.stages if s.acceptance_rate is not None
    )
    print(
        f"\n[{len(result.token_ids)} tokens in {seconds:.2f} s, {len(result.token_ids) / seconds:.1f} tokens/s, "
        f"finish: {result.finish_reason}; acceptance: {rates or 'n/a'}]",
        file=sys.stderr,
    )
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="speed side by side with the target alone and with transformers' methods")
    bench.add_argument("--config", help="cascade YAML whose stages form the family (default: the embedded demo)")
    bench.add_argument("--prompts", help="prompt file: one per line, or JSON lines with a 'prompt' field")
    bench.add_argument("--num-prompts", type=int, help="held-out prompts to draw when --prompts is not given")
    bench.add_argument("--max-tokens", type=int)
    bench.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) also checks every output")
    bench.add_argument("--repeats", type=int)
    bench.add_argument("--depths", type=int, nargs="+", help="fixed depths to try for every chain")
    bench.add_argument("--methods", nargs="+", default=[], help="method names or patterns, e.g. 'cascade:*@4'")
    bench.add_argument("--out", default="bench-out", help="directory for bench.json and the plots")
    bench.add_argument("--quick", action="store_true", help="a smaller run (under 2 minutes on the demo family)")
    bench.add_argument("--pipeline", action="store_true",
                       help="also the whole family's cascades pipelined (locally, and on Ray with a Ray config)")
    serving = bench.add_argument_group("serving mode (--serve): Cascade and the target alone behind cascade serve")
    serving.add_argument("--serve", action="store_true", help="measure over HTTP with streaming clients instead")
    serving.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="clients per level")
    serving.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    serving.add_argument("--requests", type=int, default=128,
                         help="requests per level at most, but 8 per client at least (default: 128)")
    serving.add_argument("--seconds", type=float, default=60.0,
                         help="time per level at most, emulated seconds under an emulated config (default: 60)")
    serving.add_argument("--against", metavar="CONFIG",
                         help="a second cascade YAML of the same target (e.g. the config without draft trees), served "
                         "beside the first and taking turns with it; the table adds Cascade's rate over it")
    serving.add_argument("--time-scale", type=float, metavar="S",
                         help="wall seconds per emulated second, in place of the emulated config's own")
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from cascade.bench import BenchOptions, run

    hf_logging.disable_progress_bar()
    if args.serve:
        return _bench_serving(args)
    overrides = {
        k: v
        for k, v in {
            "max_tokens": args.max_tokens, "repeats": args.repeats, "num_prompts": args.num_prompts,
            "depths": tuple(args.depths) if args.depths else None,
        }.items()
        if v is not None
    }
    common = {"temperature": args.temperature, "methods": tuple(args.methods), "prompts_file": args.prompts, "out": args.out,
              "pipeline": args.pipeline}
    options = BenchOptions.quick(**common, **overrides) if args.quick else BenchOptions(**common, **overrides)
    report = run(args.config, options)
    print(report.table)
    for path in report.files:
        print(f"wrote {path}")
    return 1 if any(m.kind == "failure" for m in report.result.mismatches) else 0  # numerical ones are reported


def _bench_serving(args: argparse.Namespace) -> int:
    try:
        from cascade.bench.serving import ServeOptions, run_serving
    except ImportError as e:  # its load generator is an extra
        raise ValueError(str(e)) from e

    options = ServeOptions(
        concurrency=tuple(args.concurrency), temperatures=tuple(args.temperatures),
        max_tokens=args.max_tokens or 64, requests=args.requests, seconds=args.seconds,
        num_prompts=args.num_prompts or 64, prompts_file=args.prompts, out=args.out, against=args.against,
        time_scale=args.time_scale,
    )
    report = run_serving(args.config, options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table)
    for path in report.files:
        print(f"wrote {path}")
    errors = sum(r.errors for r in report.rows)
    return 1 if errors else 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with Prometheus metrics")
    serve.add_argument("--config", help="cascade YAML (default: the embedded demo, built on first use)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes (visible "
                       "to `ps`: prefer --api-key-file or CASCADE_API_KEY)")
    serve.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    serve.add_argument(
        "--allowed-hosts", nargs="+", default=[], metavar="HOST",
        help="Host header names to serve besides loopback names and the bind address ('*': any). Guards a loopback "
        "server against DNS rebinding; a server bound to 0.0.0.0 with none given serves any name",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=None, help="larger request bodies get HTTP 413 (default: 4 MiB)"
    )
    serve.add_argument(
        "--max-running", type=int, default=None,
        help="requests decoding together in one batch; each holds a KV-cache slot (default: the config's "
        "batching.max_running, 64)",
    )
    serve.add_argument(
        "--max-batched-tokens", type=int, default=None,
        help="per-step token budget: prompts are prefilled in chunks of what the decoding requests leave of it "
        "(one position each), scaled by the tokens a request commits per step, at most 4x (default: the config's "
        "batching.max_batched_tokens, 512)",
    )
    serve.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests beyond which clients get 503 (default: 256)"
    )
    serve.add_argument(
        "--max-new-tokens", type=int, default=None,
        help="the most tokens one choice may generate: a request asking more gets a 400, one asking none gets this "
        "(default: no cap; a chat request without max_tokens may run to the end of the context window)",
    )
    serve.add_argument(
        "--step-timeout", type=float, default=120.0,
        help="seconds one engine step may run before the server reports itself unhealthy and fails the requests in "
        "flight with 503 (a hung stage; default: 120)",
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    import logging

    from cascade.config import load_config, packaged_config_path

    # The config and the key are read before the server's imports (seconds): a mistake in either is reported at once.
    config, api_key = load_config(args.config or packaged_config_path("demo")), _api_key(args)
    import uvicorn
    from transformers.utils import logging as hf_logging

    from cascade.server import create_app

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from cascade.server.app import DEFAULT_MAX_BODY_BYTES
    from cascade.server.middleware import allowed_hosts_for

    app = create_app(
        config, api_key=api_key, max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting, progress=True, step_timeout_s=args.step_timeout,
        max_new_tokens=args.max_new_tokens, allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
    )
    print(f"cascade: serving {app.state.server.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else CASCADE_API_KEY (None: no key)."""
    import os
    from pathlib import Path

    if args.api_key:
        return args.api_key
    if args.api_key_file:
        path = Path(args.api_key_file).expanduser()
        if not path.is_file():
            raise ValueError(f"--api-key-file: no such file {args.api_key_file!r}")
        lines = path.read_text().strip().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file!r} is empty")
        return key
    return os.environ.get("CASCADE_API_KEY") or None


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    kernels = sub.add_parser("kernels", help="the CPU attention and verification kernels").add_subparsers(
        dest="kernels_command", required=True)
    build = kernels.add_parser("build", help="compile the CPU attention kernel, and the HIP/CUDA verification "
                               "kernels when there is a GPU (cached; otherwise done on first use)")
    build.set_defaults(run=_kernels_build)
    bench = kernels.add_parser("bench", help="time each implementation; bandwidth against the op's minimum bytes")
    bench.add_argument("--device", help="cuda or cpu (default: cuda if there is a GPU)")
    bench.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    bench.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    bench.add_argument("--vocabs", type=int, nargs="+", default=[32_000, 128_000])
    bench.add_argument("--repeats", type=int)
    bench.set_defaults(run=_kernels_bench)


def _kernels_build(args: argparse.Namespace) -> int:
    import torch

    from cascade.stages import cpu_attention
    from cascade.verify import native

    failed = False
    try:
        cpu_attention.load()
        print(f"CPU attention kernel: {cpu_attention.library_path()}")
    except cpu_attention.KernelUnavailable as e:
        print(f"cascade: {e}", file=sys.stderr)
        failed = True
    if not torch.cuda.is_available():
        print("no GPU: the HIP/CUDA verification kernels are built on a machine with one")
        return int(failed)
    try:
        module = native.load()
        print(f"verification kernels: {module.__file__}")
    except native.NativeUnavailable as e:
        print(f"cascade: {e}", file=sys.stderr)
        failed = True
    return int(failed)


def _kernels_bench(args: argparse.Namespace) -> int:
    from cascade.verify import bench

    print(bench.HEADER)
    _, copy = bench.run(args.device, args.batches, args.depths, args.vocabs, args.repeats)
    print(f"device copy bandwidth: {copy / 1e9:.1f} GB/s (read + write of a large buffer)")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from cascade.emulation import command

    plan = sub.add_parser("plan", help="predict a chain's tokens/s and latency on a device at each concurrency "
                          "(roofline model; nothing runs)")
    command.add_arguments(plan)
    plan.set_defaults(run=command.run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cascade", description="Lossless hierarchical speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_zoo(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_kernels(sub)
    _add_plan(sub)
    args = parser.parse_args(argv)
    if args.command in ("generate", "bench", "serve"):  # processes that run engine steps (cascade.allocator)
        keep_freed_memory()
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # user mistakes: a message, not a traceback
        print(f"cascade: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
