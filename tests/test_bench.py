"""The benchmark harness on the `tiny` family: every method runs, the JSON is complete, mismatches are caught.
(No timing assertions: speed is measured by `cascade bench`, not by tests.)"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import emulate_stages

from cascade import Cascade
from cascade.bench import BenchOptions, run
from cascade.bench.load import MAX_SLICES, ServeOptions, level_requests, level_slices, on_the_wall
from cascade.bench.methods import CascadeMethod, HFMethod, Run, chains
from cascade.bench.prompts import file_prompts, held_out_prompts
from cascade.bench.runner import run_benchmark
from cascade.bench.serving import sustained_rate

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def greedy_report(tiny_family, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    options = BenchOptions(max_tokens=12, repeats=2, num_prompts=1, depths=(2, 3), out=str(out), progress=False)
    return run(tiny_family.config_path, options), out


@pytest.mark.slow  # the benchmark, every method
def test_every_method_runs_and_matches_the_target(greedy_report):
    report, _ = greedy_report
    names = [s.method for s in report.summaries]
    assert names[0] == "target"
    assert {"hf-assisted:small", "hf-assisted:medium", "hf-prompt-lookup", "cascade:target"} <= set(names)
    fixed = [n for n in names if n.startswith("cascade:") and "@" in n and "adaptive" not in n]
    shortcut = [n for n in fixed if n.endswith("~shortcut")]
    trees = [n for n in fixed if n.endswith("~tree")]
    assert len(fixed) - len(shortcut) - len(trees) == 7 * 2  # 7 chains of two or more stages, 2 depths each
    assert len(shortcut) == 3 * 2  # the 3 chains with the n-gram drafter and a model between it and the target
    assert len(trees) == 3 * 2  # the 3 chains with a model at the bottom, with draft trees
    assert "cascade:ngram+small+medium+target@adaptive~shortcut~tree" in names
    assert "cascade:ngram+small+medium+target@3" in names
    assert "cascade:ngram+small+medium+target@3~shortcut" in names
    assert "cascade:ngram+small+medium+target@adaptive" in names
    assert "cascade:ngram+small+medium+target@adaptive~shortcut" in names
    assert report.result.mismatches == []
    assert all(s.tokens_per_second > 0 for s in report.summaries)
    target = next(s for s in report.summaries if s.method == "target")
    assert target.speedup == pytest.approx(1.0) and target.tokens_per_target_pass is None
    # every cascade commits at least a token per pass of the target; drafting for it commits more
    per_pass = {s.method: s.tokens_per_target_pass for s in report.summaries if s.method.startswith("cascade:")}
    assert all(v >= 1 for v in per_pass.values()) and per_pass["cascade:small+target@3~tree"] > 1.2
    assert "speed-up" in report.table and "tok/pass" in report.table


@pytest.mark.slow  # the benchmark, every method
def test_json_and_plots_are_complete(greedy_report):
    _, out = greedy_report
    data = json.loads((out / "bench.json").read_text())
    assert set(data) == {"environment", "settings", "summary", "measurements", "mismatches"}
    assert {"torch", "transformers", "device", "torch_threads", "cpu_count"} <= set(data["environment"])
    assert data["settings"]["max_tokens"] == 12 and len(data["settings"]["prompts"]) == 1
    methods = data["settings"]["methods"]
    assert methods["cascade:small+target@2"] == {"kind": "cascade", "chain": ["small", "target"], "depth": 2}
    # every method x prompt x repeat was measured
    assert len(data["measurements"]) == len(methods) * 1 * 2
    m = next(m for m in data["measurements"] if m["method"] == "cascade:ngram+small+target@3")
    assert set(m["stats"]["stages"]) == {"ngram", "small", "target"}
    summary = next(s for s in data["summary"] if s["method"] == "cascade:small+medium+target@2")
    assert set(summary["stages"]) == {"small", "medium", "target"}
    assert set(summary["stages"]["small"]) == {"acceptance_rate", "mean_accepted", "accepted_by_position", "time_share"}
    for png in ("speedup.png", "acceptance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _DropsTheLastToken(CascadeMethod):
    """A cascade with a deliberate bug: it loses the last token it generated."""

    def generate(self, prompt_ids, max_tokens, temperature, seed):
        run = super().generate(prompt_ids, max_tokens, temperature, seed)
        return Run(run.token_ids[:-1], run.seconds, run.stats)


def test_a_broken_method_is_reported_as_a_mismatch(tiny_family):
    cascade = Cascade.from_config(tiny_family.config_path, progress=False)
    stages = {s.name: s for s in cascade.engine.stages}
    good = CascadeMethod("cascade:small+target@3", Cascade([stages["small"], stages["target"]], [3], cascade.tokenizer), ("small", "target"), 3)
    broken = _DropsTheLastToken("cascade:broken", good.cascade, good.chain, 3)
    methods = [HFMethod("target", stages["target"]), good, broken]
    prompts = [cascade.encode(p) for p in held_out_prompts(2)]
    result = run_benchmark(methods, prompts, max_tokens=16, temperature=0.0, repeats=1, progress=False)
    assert [m.method for m in result.mismatches] == ["cascade:broken", "cascade:broken"]
    assert all(m.got == m.expected[:-1] and m.first_difference == len(m.got) for m in result.mismatches)
    assert all(m.kind == "failure" for m in result.mismatches)  # no near-tie: a token is missing


class _ChangesAToken(CascadeMethod):
    """A cascade that commits the token after the target's at position 3 (and stops there)."""

    def generate(self, prompt_ids, max_tokens, temperature, seed):
        run = super().generate(prompt_ids, max_tokens, temperature, seed)
        return Run([*run.token_ids[:3], run.token_ids[3] + 1], run.seconds, run.stats)


def test_a_divergence_is_numerical_only_at_a_near_tie_of_the_targets_logits(tiny_family):
    import torch

    from cascade.bench.runner import classify

    cascade = Cascade.from_config(tiny_family.config_path, progress=False)
    stages = {s.name: s for s in cascade.engine.stages}
    changed = _ChangesAToken("cascade:changed", Cascade([stages["small"], stages["target"]], [3], cascade.tokenizer),
                             ("small", "target"), 3)
    methods = [HFMethod("target", stages["target"]), changed]
    prompts = [cascade.encode(held_out_prompts(1)[0])]
    target = stages["target"]

    def target_logits(context):
        seq = -1 - len(context)
        try:
            return target.score([seq], [context], [1])[0][0]
        finally:
            target.release(seq)

    [mismatch] = run_benchmark(methods, prompts, max_tokens=8, temperature=0.0, repeats=1, progress=False,
                               target_logits=target_logits).mismatches
    assert mismatch.first_difference == 3 and mismatch.kind == "failure" and mismatch.logit_gap > 1e-3
    # The rule itself, per dtype: within the stated tolerance a divergence is numerical.
    row = torch.zeros(8)
    row[1], row[2] = 5.0, 5.0 - 4e-4
    assert classify(row, 1, 2)[0] == "numerical" and classify(row.double(), 1, 2)[0] == "failure"
    row[2] = 4.0
    assert classify(row, 1, 2)[0] == "failure"
    half = torch.tensor([0.0, 9.0, 8.875]).bfloat16()
    assert classify(half, 1, 2)[0] == "numerical" and classify(half.float(), 1, 2)[0] == "failure"


def test_sampling_mode_reports_speed_only(tiny_family, tmp_path):
    options = BenchOptions(
        max_tokens=8, temperature=0.8, repeats=1, num_prompts=1, depths=(2,), out=None, progress=False,
        methods=("cascade:small+target@*", "hf-assisted:small"),
    )
    report = run(tiny_family.config_path, options)
    assert [s.method for s in report.summaries] == [
        "target", "hf-assisted:small", "cascade:small+target@2", "cascade:small+target@2~tree"]
    assert report.result.mismatches == [] and report.files == []


def test_unknown_method_pattern_is_an_error(tiny_family):
    with pytest.raises(ValueError, match="match no method"):
        run(tiny_family.config_path, BenchOptions(methods=("speculative-magic",), out=None, progress=False))


def test_chain_enumeration():
    assert chains(["ngram", "a", "b", "t"], True) == [
        ("t",), ("ngram", "t"), ("a", "t"), ("ngram", "a", "t"), ("b", "t"), ("ngram", "b", "t"),
        ("a", "b", "t"), ("ngram", "a", "b", "t"),
    ]
    assert chains(["a", "t"], False) == [("t",), ("a", "t")]


def test_prompt_files(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond prompt\n")
    assert file_prompts(plain) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "def f():\\n    return"}\n{"prompt": "x"}\n')
    assert file_prompts(jsonl) == ["def f():\n    return", "x"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        file_prompts(bad)
    with pytest.raises(FileNotFoundError):
        file_prompts(tmp_path / "missing.txt")
    assert held_out_prompts(3) == held_out_prompts(3)  # a fixed selection


@pytest.mark.slow  # a bench process (and servers)
def test_cli_quick_run(tiny_family, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "cascade.cli", "bench", "--config", str(tiny_family.config_path), "--quick",
         "--max-tokens", "8", "--repeats", "1", "--num-prompts", "1", "--methods", "cascade:ngram+target@4",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert "cascade:ngram+target@4" in done.stdout and (tmp_path / "bench.json").exists()


@pytest.mark.slow  # a bench process (and servers)
def test_cli_serving_run(tiny_family, tmp_path):
    """`cascade bench --serve`, bounded to a few requests: both servers come up, every level of every system is
    measured without errors on the user's prompt file, the table, JSON and plot are written, and the servers ran
    with slot reuse off (``batching.reuse_prefixes``: the bench's prompts repeat)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def parse(\nclass Queue:\nimport os\n")
    done = subprocess.run(
        [sys.executable, "-m", "cascade.cli", "bench", "--serve", "--config", str(tiny_family.config_path),
         "--concurrency", "1", "3", "--temperatures", "0", "0.8", "--requests", "4", "--max-tokens", "6",
         "--prompts", str(prompts), "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "serve.json").read_text())
    rows = {(r["system"], r["temperature"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(s, t, c) for s in ("cascade", "target", "transformers") for t in (0.0, 0.8) for c in (1, 3)}
    served = [r for r in rows.values() if r["system"] != "transformers"]
    assert all(r["errors"] == 0 and r["tokens_per_second"] > 0 for r in served)
    # one client: four slices of two requests per system, taken in turns; three clients: four slices of six
    assert {(r["concurrency"], r["requests"]) for r in served} == {(1, 8), (3, 24)}
    # the sustained rate (every client's request in flight) leaves out the time a client idled while the others'
    # requests drained, so it is never below the whole level's
    assert all(r["sustained_tokens_per_second"] >= r["tokens_per_second"] - 0.1 for r in served)
    assert set(report["api_speedup_at_1_client"]) == {"0.0", "0.8"}
    assert "| 0.8 | 3 |" in done.stdout and (tmp_path / "serve.png").exists()
    assert report["config"]["batching"]["reuse_prefixes"] is False  # the prompts repeat: reuse would measure that


def test_sustained_rate_is_littles_law_over_the_requests():
    # two clients: one client's requests took 2 s and 1 s for 64 tokens each, the other's one of 4 s for 64 (it then
    # idled while nothing drained); with a request always in flight each client would commit 192 tokens per 7 s
    ok = [{"seconds": 2.0, "tokens": 64}, {"seconds": 1.0, "tokens": 64}, {"seconds": 4.0, "tokens": 64}]
    assert sustained_rate(ok, 2) == pytest.approx(2 * 192 / 7, abs=0.05)
    assert sustained_rate(ok, 2, scale=10.0) == pytest.approx(10 * 2 * 192 / 7, abs=0.05)  # emulated seconds
    assert sustained_rate([], 2) is None


def test_serving_levels_are_split_into_slices_the_systems_take_turns_on():
    """Each slice keeps at least two requests per client; slices cover the level's requests once, in order."""
    assert level_slices(64, 1) == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert level_slices(64, 16) == [(0, 32), (32, 32)]
    assert level_slices(128, 64) == [(0, 128)]
    assert level_slices(level_requests(128, 64), 64) == [(0, 128), (128, 128), (256, 128), (384, 128)]  # four turns
    assert level_requests(128, 16) == 128
    assert level_slices(3, 1) == [(0, 3)]
    for requests, clients in [(65, 1), (129, 4), (7, 2), (200, 16)]:
        slices = level_slices(requests, clients)
        assert 1 <= len(slices) <= MAX_SLICES and all(count >= 2 * clients for _, count in slices)
        assert [first for first, _ in slices] == list(itertools.accumulate([0] + [count for _, count in slices][:-1]))
        assert sum(count for _, count in slices) == requests


def test_an_emulated_levels_seconds_are_emulated():
    """`--seconds` bounds a level in emulated seconds under emulation, as docs/emulation.md says: at time scale 12 a
    wall-clock bound of 15 s cut each of a level's four slices to one request per client."""
    options = ServeOptions(seconds=15.0, requests=64)
    assert on_the_wall(options, 12.0) == ServeOptions(seconds=180.0, requests=64)
    assert on_the_wall(options, 1.0) == options


@pytest.mark.slow  # a CLI process
def test_cli_serving_rejects_a_level_given_twice(tiny_family):
    """A repeated concurrency level (or temperature) was measured twice but shown once in the table: it is refused
    with a message before any server starts."""
    done = subprocess.run(
        [sys.executable, "-m", "cascade.cli", "bench", "--serve", "--config", str(tiny_family.config_path),
         "--concurrency", "16", "64", "64"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert done.returncode != 0 and "--concurrency lists a value twice (16 64 64)" in done.stderr
    assert "Traceback" not in done.stderr


def _emulated_tiny(tiny_family, device: str, time_scale: float) -> dict:
    """The tiny family's config with its models emulated on ``device`` as a 1B, an 8B and a 70B Llama."""
    import yaml

    return emulate_stages(yaml.safe_load(Path(tiny_family.config_path).read_text()), device, time_scale)


def test_serving_against_a_config_of_another_target_is_refused(tiny_family, tmp_path):
    """``--against`` must serve the config's own target, configured alike (a ratio would otherwise measure two
    targets), and the same kind of stages: refused with what differs, before any server starts."""
    import yaml

    from cascade.bench.serving import against_config, with_time_scale
    from cascade.config import load_config

    config = load_config(tiny_family.config_path)
    data = yaml.safe_load(Path(tiny_family.config_path).read_text())
    for stage in data["stages"][:-1]:
        stage["siblings"] = 2  # the drafters may differ: that is what is compared
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump(data))
    assert against_config(config, same).stages[1].siblings == 2
    data["stages"][-1]["model"] = data["stages"][-2]["model"]
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="must be the config's own"):
        against_config(config, other)
    emulated = tmp_path / "emulated.yaml"
    emulated.write_text(yaml.safe_dump(_emulated_tiny(tiny_family, "h200", 1.0)))
    with pytest.raises(ValueError, match="emulated stages and time scale must match"):
        against_config(config, emulated)
    with pytest.raises(ValueError, match="--time-scale needs a config with emulated stages"):
        against_config(config, same, time_scale=3.0)  # (--time-scale stretches the --against config too)
    assert against_config(with_time_scale(load_config(emulated), 3.0), emulated, time_scale=3.0).time_scale == 3.0


@pytest.mark.slow  # a bench process (and servers)
def test_cli_serving_run_on_emulated_stages(tiny_family, tmp_path):
    """`cascade bench --serve` with emulated stages: no transformers anchor and no Python API turns (they would time
    this CPU), and every served level reports its emulated figures — each stage's real-compute share, the host's
    share of step time, the rate with host time at full weight, what the controller did and the planner's
    prediction — and the table says its figures are emulated. ``--against`` serves a second config of the same target
    (here the same with draft trees) beside it, measured alike, and the table gives Cascade's rate over it;
    ``--time-scale`` stretches both in place of their own scale."""
    import yaml

    data = _emulated_tiny(tiny_family, "h200", 0.2)
    data["controller"] = {"mode": "adaptive"}
    config = tmp_path / "emulated.yaml"
    config.write_text(yaml.safe_dump(data))
    for stage in data["stages"][:-1]:
        stage["siblings"] = 2
    against = tmp_path / "trees.yaml"
    against.write_text(yaml.safe_dump(data))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def parse(\nclass Queue:\nimport os\n")
    done = subprocess.run(
        [sys.executable, "-m", "cascade.cli", "bench", "--serve", "--config", str(config), "--concurrency", "2",
         "--temperatures", "0", "--requests", "4", "--max-tokens", "6", "--prompts", str(prompts), "--out",
         str(tmp_path), "--against", str(against), "--time-scale", "0.1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "serve.json").read_text())
    assert "time scale 0.1" in done.stderr and report["config"]["emulation"]["time_scale"] == 0.1
    assert {r["system"] for r in report["rows"]} == {"cascade", "target", "against"}
    assert not report["api_speedup_at_1_client"]
    assert all(r["errors"] == 0 and r["tokens_per_second"] > 0 for r in report["rows"])
    assert "Cascade / against" in done.stdout
    cascade = next(r for r in report["rows"] if r["system"] == "cascade")["emulation"]
    target = next(r for r in report["rows"] if r["system"] == "target")["emulation"]
    models = [s["name"] for s in data["stages"] if s["type"] == "hf"]
    assert set(cascade["real_share"]) <= set(models) and models[-1] in cascade["real_share"]
    assert set(target["real_share"]) == {models[-1]}
    assert 0 <= cascade["host_share"] <= 1 and cascade["tokens_per_second_host_full_weight"] > 0
    assert set(cascade["controller"]) == {s["name"] for s in data["stages"][:-1]}
    assert cascade["planner"]["tokens_per_second"] > 0 and target["planner"]["chain"] == [models[-1]]
    assert "Emulated accelerators" in done.stdout and "planner tok/s" in done.stdout and "sustained tok/s" in done.stdout


def test_an_emulated_familys_bench_compares_it_with_the_emulated_target_alone(tiny_family, tmp_path):
    """`cascade bench` (not serving) on emulated stages: the baseline is the engine decoding plainly on the emulated
    target, in emulated seconds like every cascade, and transformers' methods (not emulated) are left out."""
    from cascade.config import CascadeConfig

    report = run(CascadeConfig.model_validate(_emulated_tiny(tiny_family, "mi300x", 0.5)), BenchOptions(
        max_tokens=6, repeats=1, num_prompts=1, depths=(2,), methods=("*",), out=None, progress=False))
    names = [s.method for s in report.summaries]
    assert "target" in names and not any(n.startswith("hf-") for n in names) and "cascade:target" not in names
    measured = report.result.measurements
    assert all(m.stats is not None for m in measured)  # every method ran through the engine, the target alone too
    # every figure in emulated seconds: the engine's own record of each generation agrees with the bench's
    assert all(abs(m.seconds - m.stats["seconds"]) < 0.2 * m.seconds for m in measured), [(m.seconds, m.stats["seconds"]) for m in measured]
