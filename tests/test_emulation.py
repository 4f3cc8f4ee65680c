"""Emulated accelerators: the pass-time model against hand-computed rooflines, tensor parallelism and transfers; an
emulated stage computes exactly what the stage computes unemulated; the losslessness suites on emulated, pipelined
stages; the planner's choices and ``cascade plan``. No wall-clock assertions: emulated time comes from the model, so
these check the model's numbers and the scheduling it implies."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from cascade.cli import main
from cascade.clock import Clock
from cascade.config import ConfigError, parse_config
from cascade.emulation import (
    DEVICES,
    MODELS,
    EmulatedDevice,
    EmulationSpec,
    Link,
    Row,
    device,
    model,
    pass_cost,
    pass_seconds,
    transfer_seconds,
    uniform_rows,
)
from cascade.controller.model import expected_tokens
from cascade.emulation.planner import cost_curves, fixed_rate, pair_alpha, predict
from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.stages.hf import HFStage, choose_forward
from tests.conftest import emulate_stages, perturbed_copy, random_llama
from tests.test_engine_sampling import PROMPT, VOCAB, chi_square_p_value, exact_pair_after_two, samples

MI300X = device("mi300x")
LLAMA_70B = model("llama-3.1-70b")


# ---- profiles and the roofline -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,billions", [
    ("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21), ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55),
    ("llama-3.1-405b", 405.85), ("qwen2.5-0.5b", 0.494), ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.71),
])
def test_model_shapes_have_their_published_parameter_counts(name, billions):
    assert model(name).parameters / 1e9 == pytest.approx(billions, rel=5e-3)


def test_70b_pass_at_batch_1_moves_its_weights():
    """A 70B bf16 pass at batch 1 reads its ~140 GB of weights: on MI300X at least 26 ms at peak bandwidth, and the
    model's time is exactly the layers' launches plus the bytes at the efficient bandwidth (memory-bound)."""
    cost = pass_cost(LLAMA_70B, MI300X, [Row(1, 0, 1)])
    weights = (80 * LLAMA_70B.layer_parameters + 128256 * 8192) * 2
    kv = 2 * 80 * 8 * 128 * 2  # one token's keys and values
    assert cost.bytes == weights + kv
    assert cost.bytes > 138e9
    assert cost.bound == "memory"
    assert cost.bytes / MI300X.memory_bandwidth >= 0.026
    expected = 80 * MI300X.launch_seconds + cost.bytes / (MI300X.bandwidth_efficiency * MI300X.memory_bandwidth)
    assert cost.seconds == pytest.approx(expected, rel=1e-12)


def test_long_prefill_is_compute_bound_with_causal_attention():
    rows = [Row(4096, 0, 1)]
    cost = pass_cost(LLAMA_70B, MI300X, rows)
    matmul = 2 * 80 * LLAMA_70B.layer_parameters * 4096 + 2 * 128256 * 8192 * 1
    attention = 4 * 80 * 64 * 128 * 4096 * (0 + 4097 / 2)
    assert cost.flops == pytest.approx(matmul + attention, rel=1e-12)
    assert cost.bound == "compute"
    expected = 80 * MI300X.launch_seconds + cost.flops / (MI300X.flops_efficiency * MI300X.bf16_flops)
    assert cost.seconds == pytest.approx(expected, rel=1e-12)


def test_cached_context_costs_its_kv_reads():
    short = pass_cost(LLAMA_70B, MI300X, uniform_rows(64, 1, 100))
    long = pass_cost(LLAMA_70B, MI300X, uniform_rows(64, 1, 4100))
    assert long.bytes - short.bytes == pytest.approx(64 * 4000 * 2 * 80 * 8 * 128 * 2)


def test_tensor_parallelism_splits_the_pass_and_adds_two_all_reduces_a_layer():
    rows = uniform_rows(8, 1, 512)
    one = pass_cost(LLAMA_70B, MI300X, rows)
    four = pass_cost(LLAMA_70B, MI300X, rows, gpus=4)
    launches = 80 * MI300X.launch_seconds
    ring = 2 * 3 / 4 * 8 * 8192 * 2
    all_reduce = 2 * 80 * (MI300X.peer.latency + ring / MI300X.allreduce_bandwidth)
    assert four.seconds == pytest.approx(launches + (one.seconds - launches) / 4 + all_reduce, rel=1e-12)
    assert four.seconds < one.seconds


def test_fp8_halves_the_weights_and_doubles_the_peak():
    bf16 = pass_cost(LLAMA_70B, MI300X, [Row(1, 0, 1)])
    fp8 = pass_cost(LLAMA_70B, MI300X, [Row(1, 0, 1)], dtype="fp8")
    assert fp8.bytes == pytest.approx(bf16.bytes / 2)
    assert MI300X.peak("fp8") == pytest.approx(2 * MI300X.peak("bf16"), rel=1e-3)
    for a100 in ("a100-80gb", "a100-40gb"):
        assert DEVICES[a100].peak("fp8") == DEVICES[a100].peak("bf16")  # no fp8 tensor cores


def test_transfer_is_latency_then_bandwidth():
    link = Link("test", 64e9, 15e-6)
    assert transfer_seconds(1e6, link) == pytest.approx(15e-6 + 1e6 / 64e9)
    assert transfer_seconds(0, link) == 0.0


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown device 'tpu'.*mi300x"):
        device("tpu")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*llama-3.1-70b"):
        model("gpt-5")


# ---- emulated stages ---------------------------------------------------------------------------------------


def _stage(name: str, llm, spec: EmulationSpec | None) -> HFStage:
    return HFStage(name, llm, forward=choose_forward(llm, "auto"),
                   emulation=EmulatedDevice(spec) if spec is not None else None)


def test_emulated_stage_computes_what_the_stage_computes():
    """Same logits, same argmax, same drafts; the device counts each pass with the roofline of what it fed."""
    llm = random_llama(VOCAB, 16, 2, seed=0)
    plain, emulated = _stage("plain", llm, None), _stage("em", llm, EmulationSpec("h200", "llama-3.1-8b", time_scale=0.01))
    contexts = [[1, 2, 3, 4, 5], [7, 7, 1]]
    for stage in (plain, emulated):
        stage.out = stage.score([0, 1], contexts, [2, 1])
    assert all(torch.equal(a, b) for a, b in zip(plain.out, emulated.out))
    assert [t.tolist() for t in plain.argmax([0, 1], [c + [6] for c in contexts], [1, 1])] == \
        [t.tolist() for t in emulated.argmax([0, 1], [c + [6] for c in contexts], [1, 1])]
    drafts = [s.draft([0, 1], [c + [6, 2] for c in contexts], [3, 2], [], [None, None]) for s in (plain, emulated)]
    assert [d[0] for d in drafts[0]] == [d[0] for d in drafts[1]]
    report = emulated.emulation.report()
    shape, profile = model("llama-3.1-8b"), device("h200")
    first = pass_seconds(shape, profile, [Row(5, 0, 2), Row(3, 0, 1)]) + transfer_seconds(3 * 2 * shape.vocab, profile.peer)
    assert report["passes"] == 2 + 3  # score, argmax, then a draft of three tokens: three passes
    assert report["emulated_seconds"] > first  # the first pass alone is modelled at exactly `first`
    assert report["device"] == "h200" and report["model"] == "llama-3.1-8b"


def test_device_time_is_counted_apart_from_host_time():
    llm = random_llama(VOCAB, 16, 1, seed=0)
    target = _stage("target", llm, EmulationSpec("mi300x", "llama-3.1-70b", time_scale=0.05))
    engine = CascadeEngine([target], [], eos_token_id=None, clock=Clock(0.05))
    request = engine.run(engine.add_request(PROMPT, SamplingParams(), 8))
    host = engine.host_time()
    assert len(request.generated) == 8
    assert 0 <= host["host_wall_seconds"] < host["step_wall_seconds"]
    # every pass slept out at least its stretched time: the step time holds the devices' time (not a wall-clock
    # bound on the machine: a lower bound that time.sleep guarantees)
    assert host["step_wall_seconds"] - host["host_wall_seconds"] >= 0.05 * target.emulation.modelled_seconds * 0.999


def _emulated_family(scale: float):
    target_llm = random_llama(VOCAB, 16, 1, seed=0, init_range=0.5)
    medium_llm = perturbed_copy(target_llm, 0.3, seed=1)
    bottom_llm = perturbed_copy(target_llm, 0.9, seed=2)
    specs = [("llama-3.2-1b", "bottom", bottom_llm), ("llama-3.1-8b", "medium", medium_llm),
             ("llama-3.1-70b", "target", target_llm)]
    stages = [_stage(name, llm, EmulationSpec("mi300x", m, time_scale=scale)) for m, name, llm in specs]
    return stages, target_llm


@torch.inference_mode()
def _greedy(llm, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = llm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("pipeline", [False, True], ids=["synchronous", "pipelined"])
def test_emulated_stages_decode_the_targets_greedy_text_batched(pipeline):
    """Emulated devices decide how far the drafting ahead gets while the target's (slow) pass runs; the output is
    the target's own greedy decode, requests batched together."""
    stages, target_llm = _emulated_family(scale=0.1)
    prompts = [[1, 2, 3], [4, 4, 9, 1], [11, 0, 5], [2, 7]]
    engine = CascadeEngine(stages, [3, 2], eos_token_id=None, pipeline=pipeline, clock=Clock(0.1))
    requests = [engine.add_request(p, SamplingParams(), 16) for p in prompts]
    while engine.has_work:
        engine.step()
    for prompt, request in zip(prompts, requests):
        assert request.generated == _greedy(target_llm, prompt, 16)
    if pipeline:
        assert sum(r.stats.kept_ahead for r in requests) > 0  # rounds really started from drafts made ahead
        # emulated devices are the stages' own: the drafting ahead covers the outcomes where the target rejects a token
        # (as far as the target's emulated pass leaves time for)
        assert all(engine.rounds.on_own_device(i) for i in range(len(stages)))


def test_stages_sharing_the_cpu_draft_ahead_for_all_accepted_only():
    """On the CPU the pipelined mode drafts ahead for all of the draft accepted only: drafting for more outcomes would
    slow the target's pass on the same cores. (The same models emulated are on devices of their own: above.) Asked
    for every outcome, the same engine keeps drafts made after rejections."""
    target_llm = random_llama(VOCAB, 16, 1, seed=0, init_range=0.5)
    stages = [_stage("bottom", perturbed_copy(target_llm, 0.3, seed=1), None), _stage("target", target_llm, None)]
    kept = {}
    for outcomes in (None, True):
        engine = CascadeEngine(stages, [3], eos_token_id=None, pipeline=True)
        engine.interrupt_ahead, engine.ahead_outcomes = False, outcomes  # every outcome that would be drafted is
        requests = [engine.add_request(p, SamplingParams(), 24) for p in ([1, 2, 3], [4, 4, 9, 1], [11, 0, 5])]
        while engine.has_work:
            engine.step()
        assert not any(engine.rounds.on_own_device(i) for i in range(2))
        kept[outcomes] = sum(r.stats.kept_ahead_rejected for r in requests)
    assert kept[None] == 0 and kept[True] > 0


def test_emulated_pipelined_stages_sample_the_targets_distribution():
    """Pipelined on emulated devices, drafting ahead stopped by the target's emulated pass (a stopping time): tokens
    three and four, which drafts made ahead decide, follow the target's exact distribution (chi-square, fixed seeds,
    p > 1e-3; 6,000 samples (scaled by CASCADE_TEST_SAMPLES) batched 48 at a time)."""
    params = SamplingParams(temperature=1.0)
    stages, target_llm = _emulated_family(scale=0.02)
    engine = CascadeEngine(stages, [3, 1], eos_token_id=None, max_running=48, pipeline=True, clock=Clock(0.02))
    requests = [engine.add_request(PROMPT, params, 6, seed=seed) for seed in range(samples(6000))]
    while engine.has_work:
        engine.step()
    counts = Counter(tuple(r.generated[2:4]) for r in requests)
    assert sum(r.stats.kept_ahead for r in requests) > len(requests) // 30  # drafts made ahead really kept

    @torch.inference_mode()
    def next_logits(ctx):
        return target_llm(input_ids=torch.tensor([ctx])).logits[0, -1]

    assert chi_square_p_value(counts, exact_pair_after_two(next_logits, params)) > 1e-3


# ---- config ----------------------------------------------------------------------------------------------------


def _config(emulate: dict | None, **top) -> dict:
    target = {"name": "target", "type": "hf", "model": "/nowhere"}
    if emulate is not None:
        target["emulate"] = emulate
    return {"stages": [target], **top}


def test_emulate_key_sets_the_stage_and_the_clock():
    config = parse_config(_config({"device": "h100", "model": "qwen2.5-7b", "gpus": 2}, emulation={"time_scale": 5}))
    assert config.emulated and config.time_scale == 5
    assert config.emulation_spec(config.target) == EmulationSpec("h100", "qwen2.5-7b", 2, "bf16", 5.0)
    plain = parse_config(_config(None, emulation={"time_scale": 5}))
    assert not plain.emulated and plain.time_scale == 1.0 and plain.emulation_spec(plain.target) is None


def test_emulate_key_errors_name_what_is_allowed():
    with pytest.raises(ConfigError, match=r"stages\.0\.emulate\.device.*unknown device 'tpu'.*mi300x"):
        parse_config(_config({"device": "tpu", "model": "llama-3.1-8b"}))
    with pytest.raises(ConfigError, match=r"emulation\.time_scale"):
        parse_config(_config({"device": "mi300x", "model": "llama-3.1-8b"}, emulation={"time_scale": 0}))


def test_shipped_emulated_configs_parse():
    from cascade.config import load_config, packaged_config_path

    for name in ("emulated-mi300x", "emulated-mi300x-ray"):
        config = load_config(packaged_config_path(name))
        assert config.emulated
        assert [s.emulate.model for s in config.stages[1:]] == ["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"]
    assert load_config(packaged_config_path("emulated-mi300x-ray")).runtime.backend == "ray"


def test_emulated_stages_in_process_step_on_one_thread_and_decode_alike(tiny_family):
    """In process, emulated stages' steps run on one torch thread (their real compute stands in for devices of their
    own and should not stall on the host's threads), the caller's setting is left alone, and the text is the
    unemulated cascade's."""
    import yaml

    from cascade.api import Cascade

    data = yaml.safe_load(tiny_family.config_path.read_text())
    plain = Cascade.from_config(parse_config(data))
    emulated = Cascade.from_config(parse_config(emulate_stages(data, "mi300x", 1.0)))
    assert plain.engine.step_threads is None and emulated.engine.step_threads == 1
    threads = torch.get_num_threads()
    for prompt in ["def parse(", "import os\n"]:
        assert emulated.generate(prompt, max_tokens=16).token_ids == plain.generate(prompt, max_tokens=16).token_ids
    assert torch.get_num_threads() == threads


# ---- the planner and `cascade plan` ---------------------------------------------------------------------------


CHAIN = ["ngram", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"]


def test_planner_drafts_at_one_client_and_decodes_plainly_when_compute_bound():
    rows = predict("mi300x", CHAIN, [0.5, 0.75, 0.8], [1, 1024], context=512)
    adaptive = {r.concurrency: r for r in rows if r.method == "adaptive"}
    alone = {r.concurrency: r for r in rows if r.method == "target alone"}
    assert len(adaptive[1].chain) > 1 and adaptive[1].tokens_per_second > 2 * alone[1].tokens_per_second
    assert adaptive[1024].chain == ("llama-3.1-70b",)  # a 1,024-row pass is compute-bound: drafting does not pay
    assert alone[1].itl_seconds == pytest.approx(pass_seconds(LLAMA_70B, MI300X, uniform_rows(1, 1, 512)))


def test_fixed_rate_agrees_with_the_controllers_model_at_its_chosen_depths():
    rows = predict("h200", CHAIN, [0.5, 0.7, 0.85], [1, 16], context=300)
    for best in (r for r in rows if r.method == "best ngram+llama-3.2-1b+llama-3.1-8b+llama-3.1-70b"):
        again = predict("h200", CHAIN, [0.5, 0.7, 0.85], [best.concurrency], context=300, depths=best.depths)
        fixed = next(r for r in again if r.method == "fixed")
        assert fixed.tokens_per_second == pytest.approx(best.tokens_per_second, rel=1e-9)


def test_plan_pass_prints_the_models_seconds(capsys):
    assert main(["plan", "--device", "mi300x", "--pass", "llama-3.1-70b", "--batch", "16", "--tokens", "4",
                 "--context", "1000", "--gpus", "2", "--json"]) == 0
    seconds = json.loads(capsys.readouterr().out)["seconds"]
    assert seconds == pytest.approx(pass_seconds(LLAMA_70B, MI300X, uniform_rows(16, 4, 1000), gpus=2))


def test_plan_chain_names_the_best_method(capsys):
    assert main(["plan", "--chain", *CHAIN, "--acceptance", "0.5", "0.75", "0.8", "--concurrency", "1", "256",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["best"]) == {"1", "256"}
    assert out["best"]["256"]["tokens_per_second"] >= max(
        p["tokens_per_second"] for p in out["predictions"] if p["concurrency"] == 256 and p["method"] != "adaptive")


def test_plan_reads_acceptance_from_metrics(tmp_path, capsys):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(
        "# TYPE cascade_spec_decode_num_drafts counter\n"
        'cascade_spec_decode_num_drafts_total{stage="ngram"} 50\n'
        'cascade_spec_decode_num_drafts_total{stage="small"} 50\n'
        "# TYPE cascade_spec_decode_num_draft_tokens counter\n"
        'cascade_spec_decode_num_draft_tokens_total{stage="ngram"} 100\n'
        'cascade_spec_decode_num_draft_tokens_total{stage="small"} 200\n'
        "# TYPE cascade_spec_decode_num_accepted_tokens counter\n"
        'cascade_spec_decode_num_accepted_tokens_total{stage="ngram"} 40\n'
        'cascade_spec_decode_num_accepted_tokens_total{stage="small"} 150\n'
    )
    assert main(["plan", "--chain", "ngram", "llama-3.2-1b", "llama-3.1-70b", "--acceptance-from", str(metrics),
                 "--concurrency", "1", "--json"]) == 0
    ngram, small = json.loads(capsys.readouterr().out)["acceptance"]
    assert ngram + ngram ** 2 == pytest.approx(40 / 50)  # depth 2, 0.8 accepted per draft
    assert sum(small ** j for j in range(1, 5)) == pytest.approx(150 / 50)  # depth 4, 3 accepted per draft


def test_plan_errors_are_one_line(capsys):
    assert main(["plan", "--chain", "ngram", "gpt-5", "--acceptance", "0.5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert main(["plan", "--chain", "llama-3.2-1b", "llama-3.1-8b"]) == 2
    assert "--acceptance" in capsys.readouterr().err
    assert set(MODELS) >= {"llama-3.1-405b", "qwen2.5-32b"}


# ---- the controller's cost prior -------------------------------------------------------------------------------


def test_cost_curve_starts_from_the_prior_then_follows_measurements():
    from cascade.controller import CostFit

    fit = CostFit(prior=lambda t: 0.04 + 1e-5 * t)
    assert fit(1) == pytest.approx(0.04001) and fit(100) == pytest.approx(0.041)
    fit.add(1, 0.5)
    assert fit(1) == pytest.approx(0.5)  # measured: the prior is gone
    assert CostFit()(7) == 1e-3  # no prior: the flat guess


def test_measured_costs_keep_the_rooflines_shape_between_the_counts_seen():
    """Passes measured at 64 and 256 positions, 10% above a roofline that is flat (memory-bound) up to 175 and
    linear (compute-bound) beyond: the curve at 128 and 192 follows the roofline's knee, scaled by what was measured,
    not the line between the two counts (which prices 192 positions a fifth too dear); without a prior it is that
    line."""
    from cascade.controller import CostFit

    def roofline(t):
        return max(0.040, 0.040 * t / 175)

    fit, line = CostFit(prior=roofline), CostFit()
    for _ in range(4):
        for t in (64, 256):
            fit.add(t, 1.1 * roofline(t))
            line.add(t, 1.1 * roofline(t))
    for t in (64, 128, 192, 256, 512):
        assert fit(t) == pytest.approx(1.1 * roofline(t))
    assert line(192) == pytest.approx(1.1 * (roofline(64) + (roofline(256) - roofline(64)) * (192 - 64) / 192))
    assert line(192) > 1.15 * fit(192)


def test_controller_starts_from_the_rooflines_of_emulated_and_profiled_stages():
    from cascade.controller import ControllerParams
    from cascade.emulation import PassModel

    llm = random_llama(VOCAB, 16, 1, seed=0)
    target = _stage("target", llm, EmulationSpec("mi300x", "llama-3.1-70b", time_scale=0.01))
    profiled = HFStage("small", perturbed_copy(llm, 0.3, seed=1), profile=PassModel(EmulationSpec("mi300x", "llama-3.2-1b")))
    engine = CascadeEngine([profiled, target], [2], eos_token_id=None, controller=ControllerParams(), clock=Clock(0.01))
    costs = engine.controller.regimes["greedy"].costs
    assert costs[1].verifying(3) == pytest.approx(target.emulation.prior(3))
    assert costs[0].decoding(1) == pytest.approx(PassModel(EmulationSpec("mi300x", "llama-3.2-1b")).prior(1))
    assert costs[1].verifying(3) > 10 * costs[0].decoding(1)  # a 70B pass against a 1B one


def test_profile_and_emulate_are_exclusive():
    stage = {"name": "target", "type": "hf", "model": "/nowhere", "emulate": {"device": "mi300x", "model": "llama-3.1-8b"},
             "profile": {"device": "mi300x", "model": "llama-3.1-8b"}}
    with pytest.raises(ConfigError, match="emulate or profile, not both"):
        parse_config({"stages": [stage]})
    del stage["emulate"]
    config = parse_config({"stages": [stage]})
    assert not config.emulated and config.profile_spec(config.target) == EmulationSpec("mi300x", "llama-3.1-8b")


def test_per_position_alpha_inverts_a_drafts_expected_acceptance():
    from cascade.emulation.planner import per_position_alpha

    for alpha, depth in ((0.8, 7), (0.5, 3), (0.95, 4)):
        accepted = sum(alpha ** j for j in range(1, depth + 1))  # per draft, in expectation
        assert per_position_alpha(1000 * accepted, 1000 * depth, 1000) == pytest.approx(alpha, abs=1e-9)
    assert per_position_alpha(0, 0, 0) is None
    assert 450 / 1000 < 0.8  # the counters' ratio at α 0.8, depth 7 is ~0.45: not α


def test_the_shortcut_is_predicted_step_by_step_under_load():
    """Under the n-gram shortcut the rounds of a step share it: the step pays for the models' drafting whenever one of
    its requests found no continuation. Checked against the four outcomes of two requests, written out; at one
    request it is the mixture of rounds."""
    chain, edges, hits = ["ngram", "llama-3.2-1b", "llama-3.1-70b"], [0.7, 0.75], 0.5
    alpha = pair_alpha(edges)

    def adaptive(batch):
        rows = {r.method: r for r in predict("mi300x", chain, edges, [batch], context=300, lookup_hits=hits)}
        return rows["adaptive"], rows["best ngram+llama-3.1-70b"]

    for batch in (1, 2):
        plan, lookup = adaptive(batch)
        assert plan.chain == ("llama-3.2-1b", "llama-3.1-70b")
        costs = cost_curves(chain, "mi300x", batch, 300)
        d, k = lookup.depths[0], plan.depths[0]
        e_n, e_p = expected_tokens(alpha(0, 2), d), expected_tokens(alpha(1, 2), k)

        def drafting(b):  # the small model's round at b requests, less the target's pass
            if b == 0:
                return 0.0
            at = cost_curves(chain, "mi300x", b, 300)
            return b * e_p / fixed_rate((1, 2), (k,), alpha, at, [True, False, False], b) - at[2](b * (k + 1))

        tokens = seconds = 0.0
        for found in itertools.product([True, False], repeat=batch):  # each request: a continuation found or not
            n = sum(found)
            p = hits ** n * (1 - hits) ** (batch - n)
            tokens += p * (n * e_n + (batch - n) * e_p)
            seconds += p * ((costs[0](batch) if n else 0.0) + drafting(batch - n) + costs[2](n * (d + 1) + (batch - n) * (k + 1)))
        assert plan.tokens_per_second == pytest.approx(tokens / seconds)
        if batch == 1:  # the mixture of rounds: n-gram -> target, or small -> target
            lookup_round = costs[0](1) + costs[2](d + 1)
            small_round = drafting(1) + costs[2](k + 1)
            mixture = (hits * e_n + (1 - hits) * e_p) / (hits * lookup_round + (1 - hits) * small_round)
            assert plan.tokens_per_second == pytest.approx(mixture)


def test_prefill_and_the_ngram_shortcut_enter_the_prediction():
    base = dict(context=200, concurrencies=[64])
    plain = {r.method: r for r in predict("mi300x", CHAIN, [0.6, 0.7, 0.8], **base)}
    filled = {r.method: r for r in predict("mi300x", CHAIN, [0.6, 0.7, 0.8], prompt=180, output=64, **base)}
    alone = filled["target alone"]
    fill = pass_seconds(LLAMA_70B, MI300X, uniform_rows(64, 180, 90))
    assert alone.tokens_per_second == pytest.approx(64 * 64 / (64 * 64 / plain["target alone"].tokens_per_second + fill))
    assert alone.itl_seconds == plain["target alone"].itl_seconds  # prefill is not an inter-token gap
    never = next(r for r in predict("mi300x", CHAIN, [0.6, 0.7, 0.8], lookup_hits=0.0, **base) if r.method == "adaptive")
    always = next(r for r in predict("mi300x", CHAIN, [0.6, 0.7, 0.8], lookup_hits=1.0, **base) if r.method == "adaptive")
    lookup = plain["best ngram+llama-3.1-70b"]
    assert always.tokens_per_second == pytest.approx(lookup.tokens_per_second)  # every round n-gram -> target
    assert never.chain[0] != "ngram"
    with pytest.raises(ValueError, match="lookup_hits"):
        predict("mi300x", CHAIN[1:], [0.7, 0.8], [1], lookup_hits=0.5)


def test_a_stage_that_drafted_a_few_times_in_a_level_is_judged_on_the_whole_run():
    """A bypassed stage still drafts now and then (the controller's checks): two drafts of three tokens, all kept,
    read α = 1.0, which would send the planner to a chain the controller rightly left. Below ``MIN_DRAFTS`` drafts in
    the level, the stage's counters over the run so far stand in."""
    from cascade.bench.emulated import MIN_DRAFTS, controller_figures

    def samples(drafts, drafted, accepted):
        label = (("stage", "medium"),)
        return {("cascade_spec_decode_num_drafts_total", label): drafts,
                ("cascade_spec_decode_num_draft_tokens_total", label): drafted,
                ("cascade_spec_decode_num_accepted_tokens_total", label): accepted}

    run = samples(300, 1200, 600)
    few = controller_figures(samples(2, 6, 6), run, ["medium", "target"])["medium"]
    assert few["drafts"] == 300 and few["acceptance"] == 0.5 and few["alpha"] < 1.0
    level = samples(MIN_DRAFTS, 4 * MIN_DRAFTS, 3 * MIN_DRAFTS)
    many = controller_figures(level, run, ["medium", "target"])["medium"]
    assert many["drafts"] == MIN_DRAFTS and many["acceptance"] == 0.75


def test_the_planner_reads_each_pair_of_stages_acceptance_where_it_was_measured():
    """A drafter's tokens checked by the stage above it and, where the chain bypassed that stage, by the target
    are accepted at different rates: the planner takes each pair's own (``cascade_spec_decode_pair_*``), and a pair
    that verified too few drafts keeps the drafter's rate by whichever stage verified them."""
    from cascade.bench.emulated import MIN_DRAFTS, controller_figures, planner_prediction
    from cascade.config import parse_config

    def samples(verifier, drafts, drafted, accepted):
        pair = (("stage", "small"), ("verifier", verifier))
        return {("cascade_spec_decode_pair_drafts_total", pair): drafts,
                ("cascade_spec_decode_pair_draft_tokens_total", pair): drafted,
                ("cascade_spec_decode_pair_accepted_tokens_total", pair): accepted}

    stage = (("stage", "small"),)
    n = 2 * MIN_DRAFTS
    level = {("cascade_spec_decode_num_drafts_total", stage): n + MIN_DRAFTS,
             ("cascade_spec_decode_num_draft_tokens_total", stage): 4 * (n + MIN_DRAFTS),
             ("cascade_spec_decode_num_accepted_tokens_total", stage): 3 * n + MIN_DRAFTS,
             **samples("medium", n, 4 * n, 3 * n), **samples("target", MIN_DRAFTS, 4 * MIN_DRAFTS, MIN_DRAFTS)}
    figures = controller_figures(level, level, ["small", "medium", "target"])
    pairs = figures["small"]["pairs"]
    assert set(pairs) == {"medium", "target"} and pairs["medium"] > 0.8 > 0.6 > pairs["target"]
    config = parse_config({"stages": [
        {"name": "small", "type": "hf", "model": "zoo:demo/small", "emulate": {"device": "mi300x", "model": "llama-3.2-1b"}},
        {"name": "medium", "type": "hf", "model": "zoo:demo/medium", "emulate": {"device": "mi300x", "model": "llama-3.1-8b"}},
        {"name": "target", "type": "hf", "model": "zoo:demo/target", "emulate": {"device": "mi300x", "model": "llama-3.1-70b"}},
    ]})
    figures["medium"] = {**figures["small"], "alpha": 0.8, "pairs": {}}
    measured = planner_prediction(config, figures, 512, 1, 64)["tokens_per_second"]
    figures["small"]["pairs"] = {"medium": pairs["medium"]}  # the pair to the target unmeasured: the drafter's rate
    assumed = planner_prediction(config, figures, 512, 1, 64)["tokens_per_second"]
    assert assumed > measured
