"""Greedy losslessness: every cascade produces token for token what the target's own `generate` produces.

The oracle is transformers' `model.generate(do_sample=False)`, which nobody here wrote.
"""

from __future__ import annotations

import random

import pytest
import torch

from cascade import Cascade
from cascade.config import parse_config
from cascade.controller import ControllerParams
from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.stages.ngram import NGramDrafter
from tests.conftest import hf_stage, perturbed_copy, random_llama

EOS = 5
NUM_PROMPTS = 24
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=[48, 16], ids=["vocab48", "vocab16"])
def vocab(request):
    return request.param


def build_models(vocab: int) -> dict:
    """A random target with drafters of several kinds: noisy copies that agree often, and unrelated smaller ones."""
    target = random_llama(vocab, 48, 2, seed=0, eos_token_id=EOS)
    return {
        "target": target,
        "close": perturbed_copy(target, 0.05, seed=1),
        "closer": perturbed_copy(target, 0.02, seed=2),
        "medium": perturbed_copy(target, 0.15, seed=3),
        "tiny16": random_llama(vocab, 16, 1, seed=4, eos_token_id=EOS),
        "small32": random_llama(vocab, 32, 1, seed=5, eos_token_id=EOS),
    }


def build_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(vocab)
    out = []
    for i in range(NUM_PROMPTS):
        length = 1 if i == 0 else rng.randint(2, 24)  # includes a one-token prompt
        tokens = [rng.randrange(6, vocab) for _ in range(length)]
        if i % 3 == 0 and length > 4:  # some repetition, so the n-gram drafter finds matches
            tokens = tokens + tokens[: length // 2]
        out.append(tokens)
    return out


def target_greedy(target, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy decode of each prompt: what every cascade must reproduce."""
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        refs.append(out[0, len(p) :].tolist())
    return refs


@pytest.fixture(scope="module")
def models(vocab):
    return build_models(vocab)


@pytest.fixture(scope="module")
def prompts(vocab):
    return build_prompts(vocab)


@pytest.fixture(scope="module")
def reference(models, prompts):
    return target_greedy(models["target"], prompts)


CHAINS = {
    "1-stage": ["target"],
    "2-stage": ["close", "target"],
    "2-stage-unrelated": ["tiny16", "target"],
    "ngram+target": ["ngram", "target"],
    "ngram-earliest+2-stage": ["ngram-earliest", "close", "target"],
    "3-stage": ["medium", "close", "target"],
    "3-stage-mixed": ["small32", "closer", "target"],
    "3-stage-transformers-drafters": ["medium:transformers", "close:transformers", "target"],
    "ngram+3-stage": ["ngram", "medium", "close", "target"],
    "ngram-consensus+3-stage": ["ngram-consensus", "small32", "close", "target"],
    "4-stage": ["tiny16", "medium", "closer", "target"],
    "ngram+4-stage": ["ngram", "tiny16", "medium", "close", "target"],
}


def _stages(models, chain):
    drafters = {
        "ngram": NGramDrafter(max_ngram=3),
        "ngram-earliest": NGramDrafter(max_ngram=2, match="earliest"),
        "ngram-consensus": NGramDrafter(max_ngram=3, match="consensus"),
    }
    stages = []
    for n in chain:
        name, _, forward = n.partition(":")  # drafters run the lean forward unless a name says otherwise
        stages.append(drafters[n] if n in drafters else hf_stage(name, models[name], forward or "auto"))
    return stages


# An adaptive controller tuned to change its mind often: no warm-up, no hysteresis, frequent exploration.
RESTLESS = ControllerParams(warmup_rounds=0, hysteresis=0.0, explore_every=2, max_depth=8)
# And one that checks every other step the modes it does not run (drafting, found continuations, draft trees).
RESTLESS_CHECKS = ControllerParams(warmup_rounds=0, hysteresis=0.0, explore_every=2, max_depth=8, check_every=2,
                                   check_steps=1)


def run_each(models, prompts, reference, chain: str, controller: str, interrupt_ahead: bool = True,
             which: slice = slice(None), **options) -> list:
    """Every prompt (or those ``which`` picks) through a fresh engine over ``chain`` (depths 1..8 cycling with the
    prompt and differing between levels), each output checked against the target's own greedy decode; the finished
    requests."""
    stages = _stages(models, CHAINS[chain])
    requests = []
    for i, (prompt, expected) in list(enumerate(zip(prompts, reference)))[which]:
        depths = [1 + (i + 3 * level) % 8 for level in range(len(stages) - 1)]
        params = {"adaptive": RESTLESS, "adaptive-checking": RESTLESS_CHECKS}.get(controller)
        engine = CascadeEngine(stages, depths, eos_token_id=EOS, controller=params, **options)
        engine.interrupt_ahead = interrupt_ahead
        # drafting ahead to full depth: for every outcome, as on separate devices (the stages share the CPU here);
        # stopped by the target's pass: as on the CPU, for all of the draft accepted only
        engine.ahead_outcomes = not interrupt_ahead
        request = engine.run(engine.add_request(prompt, SamplingParams(), NEW_TOKENS))
        assert request.generated == expected, f"prompt {i} depths {depths}"
        requests.append(request)
    return requests


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("chain", list(CHAINS), ids=list(CHAINS))
def test_greedy_matches_target_generate(models, prompts, reference, chain, controller):
    stages = CHAINS[chain]
    requests = run_each(models, prompts, reference, chain, controller)
    accepted = sum(s.accepted for r in requests for s in r.stats.stages)
    changes = sum(r.stats.topology_changes for r in requests)
    if len(stages) > 1 and chain != "2-stage-unrelated":
        assert accepted > 0  # drafts were really accepted, so the accept path was exercised
    if controller == "adaptive" and len(stages) > 2:
        assert changes > 0  # the chain really changed between rounds


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("chain", ["2-stage", "3-stage", "ngram+3-stage", "3-stage-transformers-drafters", "4-stage"])
def test_pipelined_greedy_matches_target_generate(models, prompts, reference, chain, controller):
    """The pipelined mode (the next round drafted while the target verifies) commits the target's own decode, with
    the drafting ahead stopped whenever the target's pass is done (timing decides how far it got) and drafting to
    its full depth (each for half the prompts: every depth 1..8 either way); with a fixed plan and full depth (no
    timing involved), rounds really start from drafts made ahead, some of them drafted for an outcome where the target
    rejected a draft token (the drafter's guess at the token it committed instead)."""
    half = len(prompts) // 2
    run_each(models, prompts, reference, chain, controller, which=slice(half), pipeline=True)
    requests = run_each(models, prompts, reference, chain, controller, interrupt_ahead=False, which=slice(half, None),
                        pipeline=True)
    if controller == "fixed":
        assert sum(r.stats.kept_ahead for r in requests) > 0
        assert sum(r.stats.kept_ahead_rejected for r in requests) > 0


def test_eos_ends_generation_like_the_target(models, prompts, reference):
    ended = [i for i, ref in enumerate(reference) if ref and ref[-1] == EOS]
    assert ended, "the fixture should contain prompts whose greedy continuation reaches EOS"
    engine = CascadeEngine(_stages(models, CHAINS["3-stage"]), [8, 8], eos_token_id=EOS)
    for i in ended:
        request = engine.run(engine.add_request(prompts[i], SamplingParams(), NEW_TOKENS))
        assert request.generated == reference[i]
        assert request.finish_reason == "stop"


def test_draft_longer_than_tokens_left(models, prompts, reference):
    engine = CascadeEngine(_stages(models, CHAINS["3-stage"]), [8, 8], eos_token_id=EOS)
    for max_tokens in (1, 2, 3, 7):
        request = engine.run(engine.add_request(prompts[1], SamplingParams(), max_tokens))
        expected = reference[1][:max_tokens]
        assert request.generated == expected
        assert request.finish_reason == ("stop" if expected[-1] == EOS else "length")


def test_tiny_family_cascades_match_target(tiny_family):
    """The zoo's distilled family: real agreement between members, every prefix chain, with the n-gram drafter."""
    from cascade.zoo.build import load_family

    family = load_family(tiny_family.path)
    names = list(family.info["members"])
    prompts_text = [
        "def __init__(self",
        "import os\nimport sys\n\n",
        "class Foo(object):\n    def",
        "    return self._",
        "for i in range(",
        "x = [1, 2, 3]\nx = [1, 2, ",
        "if __name__ == '__main__':\n",
        "try:\n    import",
        "# Copyright",
        "def f(a, b):\n    return a + b\n\ndef g(a, b):\n    return a",
        "raise ValueError(",
        "self.assertEqual(",
        "with open(path) as f:\n",
        "@property\ndef name(self):\n",
        "lambda x:",
        "from . import",
        "while True:\n",
        "return None\n",
        "'''Docstring.",
        "elif",
    ]
    target_dir = family.member_path(names[-1])
    ref_engine = Cascade.from_config(
        parse_config({"stages": [{"name": "target", "type": "hf", "model": str(target_dir)}]}), progress=False
    )
    model = ref_engine.engine.target.model
    eos = ref_engine.tokenizer.eos_token_id
    encoded = [ref_engine.encode(p) for p in prompts_text]
    refs = []
    for ids in encoded:
        t = torch.tensor([ids])
        refs.append(model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist())
    chains = [names[-2:], names, ["ngram"] + names, ["ngram", names[-1]]]
    for chain in chains:
        stages_cfg = []
        for j, n in enumerate(chain):
            if n == "ngram":
                stages_cfg.append({"name": "ngram", "type": "ngram", "depth": 1 + j * 3})
            else:
                stages_cfg.append({"name": n, "type": "hf", "model": str(family.member_path(n)), "depth": 2 + 2 * j})
        cascade = Cascade.from_config(parse_config({"stages": stages_cfg}), progress=False)
        assert cascade.tokenizer.eos_token_id == eos
        for ids, ref in zip(encoded, refs):
            result = cascade.generate(ids, max_tokens=32)
            assert result.token_ids == ref, f"chain {chain} prompt {cascade.tokenizer.decode(ids)!r}"
        rates = [s.acceptance_rate for s in result.stats.stages[:-1]]
        assert all(r is not None for r in rates)


SHORTCUT_CHAINS = ["ngram-earliest+2-stage", "ngram+3-stage", "ngram-consensus+3-stage", "ngram+4-stage"]


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("chain", SHORTCUT_CHAINS)
def test_greedy_with_ngram_shortcut_matches_target(models, prompts, reference, chain, controller):
    """The n-gram drafter drafts straight for the target when it finds a match, else the models draft."""
    requests = run_each(models, prompts, reference, chain, controller, shortcut=True)
    direct = sum(n for r in requests for c, n in r.stats.chains.items() if c.count("+") == 1 and c.startswith("ngram"))
    assert direct > 0  # some rounds really went straight from the n-gram drafter to the target


class DraftCounter:
    """An observer counting the drafts the engine reports, per stage."""

    def __init__(self):
        self.drafts: dict[str, int] = {}
        self.pairs: dict[tuple[str, str], int] = {}  # (drafter, verifier) -> drafts
        self.empty = 0

    def on_plan(self, chain, depths, rounds, changed):
        pass

    def on_draft(self, stage, verifier, drafted, accepted, branch_tokens, branch_accepted, branch_rank):
        self.drafts[stage] = self.drafts.get(stage, 0) + 1
        self.pairs[(stage, verifier)] = self.pairs.get((stage, verifier), 0) + 1
        self.empty += drafted == 0

    def on_forward(self, stage, num_positions, seconds):
        pass

    def on_step(self, batch, tokens):
        pass


def test_request_stats_and_the_metrics_count_the_same_drafts(models, prompts, reference):
    """An empty draft (the n-gram drafter found nothing; a depth of 0) is not a draft for the request's stats nor
    for the metrics, so the JSON's mean accepted per draft is the PromQL one. Each draft is counted with the stage
    that verified it: the next one, or one further up where the round's chain (the shortcut's, the controller's)
    bypassed those between."""
    stages = _stages(models, CHAINS["ngram+3-stage"])
    engine = CascadeEngine(stages, [4, 3, 2], eos_token_id=EOS, controller=RESTLESS, shortcut=True)
    engine.observer = counter = DraftCounter()
    requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [r.generated for r in requests] == reference
    counted: dict[str, int] = {}
    for request in requests:
        for stage in request.stats.stages:
            counted[stage.name] = counted.get(stage.name, 0) + stage.drafts
    assert counter.empty == 0
    assert {n: c for n, c in counted.items() if c} == counter.drafts
    ngram = next(s for r in requests for s in r.stats.stages if s.name == "ngram" and s.drafts)
    assert ngram.mean_accepted == ngram.accepted / ngram.drafts and ngram.drafted >= ngram.drafts
    order = [s.name for s in stages]
    assert all(order.index(drafter) < order.index(verifier) for drafter, verifier in counter.pairs)
    assert {n: sum(c for (d, _), c in counter.pairs.items() if d == n) for n in counter.drafts} == counter.drafts
    assert len({v for d, v in counter.pairs if d == "medium"}) > 1  # the controller's chains bypass "close"


def test_shortcut_needs_an_ngram_drafter_at_the_bottom(models):
    with pytest.raises(ValueError, match="shortcut"):
        CascadeEngine(_stages(models, CHAINS["3-stage"]), [2, 2], eos_token_id=EOS, shortcut=True)


@pytest.mark.parametrize("pipeline", [False, True], ids=["synchronous", "pipelined"])
@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("chain", ["1-stage", "ngram+3-stage", "3-stage-transformers-drafters"])
def test_batched_requests_joining_and_leaving_match_target(models, prompts, reference, chain, controller, vocab, pipeline):
    """Continuous batching: requests arrive at random steps, are cancelled at random points, prefill in small
    chunks beside decoding ones, and each one's output is still the target's own greedy decode (also pipelined)."""
    rng = random.Random(7)
    params = RESTLESS if controller == "adaptive" else None
    engine = CascadeEngine(
        _stages(models, CHAINS[chain]), [3] * (len(CHAINS[chain]) - 1), eos_token_id=EOS, controller=params,
        shortcut=chain.startswith("ngram"), max_running=6, max_batched_tokens=8,  # prompts need several chunks
        pipeline=pipeline,
    )
    arrivals = list(range(len(prompts))) * 2
    rng.shuffle(arrivals)
    submitted: list[tuple[int, int, object]] = []
    cancelled = set()
    steps = 0
    while arrivals or engine.has_work:
        for _ in range(rng.choice([0, 0, 1, 3])):
            if arrivals:
                i = arrivals.pop()
                max_tokens = rng.randint(1, NEW_TOKENS)
                submitted.append((i, max_tokens, engine.add_request(prompts[i], SamplingParams(), max_tokens)))
        running = [r for _, _, r in submitted if not r.finished]
        if running and rng.random() < 0.05:
            victim = rng.choice(running)
            engine.finish(victim, "abort")
            cancelled.add(id(victim))
        engine.step()
        steps += 1
        assert len(engine.running) <= 6
    assert steps > len(prompts)  # requests really overlapped and came and went over many steps
    for i, max_tokens, request in submitted:
        expected = reference[i][:max_tokens]
        if id(request) in cancelled:
            assert request.finish_reason == "abort" and request.generated == expected[: len(request.generated)]
        else:
            assert request.generated == expected, f"prompt {i} max_tokens {max_tokens}"
    assert all(s.num_cached_sequences() == 0 for s in engine.stages if hasattr(s, "num_cached_sequences"))


def test_speculation_does_not_admit_a_waiting_prompt_more_slowly_than_the_target_alone(models, prompts, vocab):
    """A prompt arriving while requests decode is prefilled in chunks of the step budget; a cascade's drafted
    positions are not charged to it, and the chunk grows with the tokens a request commits per step, so the prompt
    reaches its first token in no more steps than beside the target alone decoding the same requests."""
    long_prompt = [t for p in prompts for t in p][:60]

    def steps_to_first_token(chain: str) -> int:
        engine = CascadeEngine(_stages(models, CHAINS[chain]), [4] * (len(CHAINS[chain]) - 1), eos_token_id=EOS,
                               max_batched_tokens=16)
        decoding = [engine.add_request(p, SamplingParams(), 200, ignore_eos=True) for p in prompts[1:5]]
        while not all(r.generated for r in decoding):
            engine.step()
        late = engine.add_request(long_prompt, SamplingParams(), 4)
        steps = 0
        while not late.generated:
            engine.step()
            steps += 1
        assert len(late.generated) >= 1 and not any(r.finished for r in decoding)
        return steps

    assert steps_to_first_token("2-stage") <= steps_to_first_token("1-stage")


class PassCounter:
    """An observer that counts each stage's forward passes (the engine tells it of every one)."""

    def __init__(self):
        self.passes: dict[str, int] = {}

    def on_forward(self, stage: str, positions: int, seconds: float) -> None:
        self.passes[stage] = self.passes.get(stage, 0) + 1

    def on_plan(self, *args) -> None: ...

    def on_draft(self, *args) -> None: ...

    def on_step(self, *args) -> None: ...


@pytest.mark.parametrize("chain", ["1-stage", "3-stage"])
def test_a_prompt_within_the_step_budget_is_computed_in_the_steps_target_pass(models, prompts, reference, chain):
    """A prompt whose rest fits in the step's prefill budget gets no pass of its own: the target's verifying pass
    computes it with the request's first round, so a step makes one target pass however many prompts arrive; a
    prompt longer than the budget is fed in chunks first, its last chunk joining a round. Every output is still the
    target's own greedy decode."""
    budget = len(prompts[0]) + len(prompts[1])  # both first prompts fit; the long one needs chunks
    long_prompt = ([t for p in prompts for t in p] * 3)[: 3 * budget]
    long_reference = target_greedy(models["target"], [long_prompt])[0]
    counter = PassCounter()
    engine = CascadeEngine(_stages(models, CHAINS[chain]), [3] * (len(CHAINS[chain]) - 1), eos_token_id=EOS,
                           max_batched_tokens=budget, observer=counter)
    decoding = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts[:2]]
    engine.step()  # both prompts and their first rounds: one pass of the target
    assert counter.passes["target"] == 1 and all(r.generated for r in decoding)
    late = engine.add_request(long_prompt, SamplingParams(), NEW_TOKENS)
    steps = 0
    while not late.generated:
        engine.step()
        steps += 1
    assert steps > 1  # it needed chunks: a pass of its own in each step but the last
    assert counter.passes["target"] == 1 + steps + (steps - 1)
    while engine.has_work:
        engine.step()
    assert [r.generated for r in decoding] == reference[:2] and late.generated == long_reference


def test_the_controller_plans_with_the_prompt_tokens_each_step_prefills(models, prompts):
    """The drafters read every prompt once, so the plans charge drafting for the prompt tokens arriving per step:
    the engine reports what the target prefilled each step to the controller (a decayed mean over the steps)."""
    engine = CascadeEngine(_stages(models, CHAINS["2-stage"]), [3], eos_token_id=EOS, controller=ControllerParams(),
                           max_batched_tokens=8)
    stats = engine.controller.regimes["greedy"]
    requests = [engine.add_request(p, SamplingParams(), 4) for p in prompts[:3]]
    expected, steps = 0.0, 0
    while any(r.prefilled < len(r.prompt) - 1 for r in requests):
        before = sum(r.prefilled for r in requests)
        engine.step()
        fed = sum(r.prefilled for r in requests) - before
        expected += (fed - expected) / ControllerParams().rate_window
        steps += 1
        assert stats.prompt_rate == pytest.approx(expected)
    assert steps > 1 and stats.prompt_rate > 0
    while engine.has_work:
        engine.step()
    settled = stats.prompt_rate
    engine.add_request(prompts[0][:2], SamplingParams(), 8)  # a one-token prefill, then decoding only
    while engine.has_work:
        engine.step()
    assert stats.prompt_rate < settled


def test_each_sampling_regime_prices_the_passes_its_requests_took(models, prompts):
    """A pass over sampled requests costs more than over greedy ones (warping, sampling and rejection over the
    vocabulary), so each regime's plans read cost curves of its own: a pass goes into the curves of the regimes of
    its requests, both where they are mixed, and never into another regime's."""
    engine = CascadeEngine(_stages(models, CHAINS["2-stage"]), [3], eos_token_id=EOS, controller=ControllerParams())
    greedy, sampled = engine.controller.regimes["greedy"].costs, engine.controller.regimes["sampling"].costs

    def curves(costs):  # what every curve prices a pass at, over token counts from 1 to 16
        return [[fit(t) for t in range(1, 17)] for stage in costs for fit in (stage.verify, stage.plain)]

    def run(*params):
        for p, sampling in zip(prompts, params):
            engine.add_request(p, sampling, 8)
        while engine.has_work:
            engine.step()

    run(SamplingParams())
    assert greedy[-1].verify.observed or greedy[-1].plain.observed
    assert not any(stage.verify.observed or stage.plain.observed for stage in sampled)
    before = curves(greedy)
    run(SamplingParams(temperature=0.8))
    assert sampled[-1].verify.observed and curves(greedy) == before
    before_greedy, before_sampled = curves(greedy), curves(sampled)
    run(SamplingParams(), SamplingParams(temperature=0.8))
    assert curves(greedy) != before_greedy and curves(sampled) != before_sampled


def test_python_api_generates_a_list_of_prompts_together(tiny_family):
    """``Cascade.generate([...])`` runs the prompts batched and returns one result per prompt, in order, each what
    the prompt gives alone; ``ignore_eos`` runs to max_tokens."""
    cascade = Cascade.from_config(tiny_family.config_path, progress=False)
    prompts = ["def parse(", "import os\n", cascade.encode("class A:\n")]
    together = cascade.generate(prompts, max_tokens=12)
    assert [r.token_ids for r in together] == [cascade.generate(p, max_tokens=12).token_ids for p in prompts]
    assert all(len(r.token_ids) == 40 for r in cascade.generate(prompts, max_tokens=40, ignore_eos=True))


def test_min_tokens_is_the_targets_decode_with_eos_forbidden_until_then(models, prompts):
    """Every chain reproduces transformers' greedy decode with ``min_new_tokens`` (EOS masked out early) on the
    prompts whose plain greedy decode ends early, batched together."""
    target = models["target"]
    plain = target_greedy(target, prompts)
    early = [i for i, ref in enumerate(plain) if ref and ref[-1] == EOS and len(ref) < NEW_TOKENS - 4]
    assert early, "the fixture should contain prompts whose greedy continuation ends early"
    minimum = {i: len(plain[i]) + 3 for i in early}
    expected = {}
    for i in early:
        ids = torch.tensor([prompts[i]])
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=minimum[i], do_sample=False)
        expected[i] = out[0, len(prompts[i]):].tolist()
    for chain in ("1-stage", "3-stage", "ngram+3-stage"):
        engine = CascadeEngine(_stages(models, CHAINS[chain]), [4] * (len(CHAINS[chain]) - 1), eos_token_id=EOS)
        requests = {i: engine.add_request(prompts[i], SamplingParams(), NEW_TOKENS, min_tokens=minimum[i]) for i in early}
        while engine.has_work:
            engine.step()
        for i, request in requests.items():
            assert request.generated == expected[i], chain
            assert len(request.generated) >= minimum[i]


def test_every_end_of_sequence_id_ends_a_request(models, prompts, tmp_path):
    """With two EOS ids (as Llama 3.1 and Qwen2.5 list in generation_config), every chain stops where
    transformers' generate with both stops, the drafters' own drafts included; the API reads the list."""
    from transformers import GenerationConfig

    from cascade.api import end_of_sequence_ids

    target = models["target"]
    plain = target_greedy(target, prompts)
    # The second id: a token the plain decodes produce somewhere in their middle, so it really ends some early.
    counts = {t: sum(t in ref[:-2] for ref in plain) for t in range(6, 48) if t != EOS}
    second = max(counts, key=counts.get)
    assert counts[second] >= 2
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=[EOS, second])
        expected.append(out[0, len(p):].tolist())
    assert sum(ref[-1] == second for ref in expected) >= 2
    for chain in ("1-stage", "3-stage", "ngram+3-stage"):
        engine = CascadeEngine(_stages(models, CHAINS[chain]), [4] * (len(CHAINS[chain]) - 1),
                               eos_token_id=[EOS, second])
        requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts]
        while engine.has_work:
            engine.step()
        assert [r.generated for r in requests] == expected, chain
        assert all(r.finish_reason == ("stop" if r.generated[-1] in (EOS, second) else "length") for r in requests)

    GenerationConfig(eos_token_id=[EOS, second]).save_pretrained(tmp_path)

    class Tokenizer:
        eos_token_id = 3

    assert end_of_sequence_ids(str(tmp_path), Tokenizer()) == [EOS, second, 3]
    assert end_of_sequence_ids(str(tmp_path / "nothing-here"), Tokenizer()) == [3]


@pytest.mark.parametrize("chain", ["1-stage", "ngram+3-stage"])
def test_requests_that_begin_alike_reuse_a_finished_ones_cache_and_still_match_target(models, vocab, chain):
    """A prompt sent again, one that extends an earlier one and ones that share its first tokens then differ take
    over the slot a finished request left behind (``reuse_prefixes``): the target computes fewer positions than with
    reuse off, in the same arrivals, every output is still the target's own greedy decode, whatever was cancelled or batched
    beside it, and the slots are those the engine started with. The depths are fixed: an adaptive controller's plans
    follow measured times, and under another load (two pytest workers) its drafts moved the target's positions by more
    than reuse saved (1,260 with reuse, 1,239 without)."""
    rng = random.Random(11)
    bases = [[rng.randrange(6, vocab) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    prompts = []
    for base in bases:
        prompts += [base, base + [rng.randrange(6, vocab) for _ in range(5)], base[:18] + [rng.randrange(6, vocab)]]
    prompts += [bases[0][:10]]  # too short to be looked for: a fresh slot
    reference = target_greedy(models["target"], prompts)

    def run(reuse: bool) -> tuple[list, int, CascadeEngine]:
        rng = random.Random(12)  # the same arrivals and cancellations either way
        stages = _stages(models, CHAINS[chain])
        for stage in stages:
            if hasattr(stage, "reuse_prefixes"):
                stage.reuse_prefixes = reuse
        engine = CascadeEngine(stages, [3] * (len(stages) - 1), eos_token_id=EOS, shortcut=chain.startswith("ngram"),
                               max_running=2, max_batched_tokens=8)
        slots = [stage.kv_cache_bytes() for stage in stages if hasattr(stage, "kv_cache_bytes")]
        order = list(range(len(prompts))) * 3
        rng.shuffle(order)
        submitted = []
        while order or engine.has_work:
            if order and rng.random() < 0.6:
                i = order.pop()
                submitted.append((i, engine.add_request(prompts[i], SamplingParams(), NEW_TOKENS)))
            running = [r for _, r in submitted if not r.finished]
            if running and rng.random() < 0.05:
                engine.finish(rng.choice(running), "abort")
            engine.step()
        assert [stage.kv_cache_bytes() for stage in stages if hasattr(stage, "kv_cache_bytes")] == slots
        assert all(s.num_cached_sequences() == 0 for s in stages if hasattr(s, "num_cached_sequences"))
        return submitted, engine.target.new_tokens, engine

    for reuse in (True, False):
        submitted, computed, engine = run(reuse)
        for i, request in submitted:
            expected = reference[i]
            if request.finish_reason == "abort":
                expected = expected[: len(request.generated)]
            assert request.generated == expected, f"prompt {i}, reuse {reuse}"
        if reuse:
            with_reuse, reused = computed, engine.target.reused_tokens
        else:
            assert engine.target.reused_tokens == 0
            assert reused >= 100 and with_reuse < computed, (with_reuse, computed, reused)


@pytest.mark.parametrize("controller", ["fixed", "adaptive-checking"])
@pytest.mark.parametrize("chain", ["2-stage", "2-stage-unrelated", "3-stage", "ngram+3-stage", "3-stage-transformers-drafters"])
def test_draft_trees_commit_the_targets_greedy_decode(models, prompts, reference, chain, controller):
    """With two siblings beside every token the bottom stage drafts (a draft tree, scored in one pass by the stage
    above it: the target, or a middle stage whose path through the tree goes up as its draft) and two beside every
    token a middle stage drafts (its next likeliest at each token's row), every output is still the target's own
    greedy decode, and branches are really accepted (where the drafter's token was wrong and
    its runner-up right); the transformers-forward drafters propose trees too, and the adaptive controller's
    bypasses make the bottom model draft for the target (checking trees every other step, so that they run within
    each short request)."""
    siblings = [2] * len(CHAINS[chain])
    requests = run_each(models, prompts, reference, chain, controller, siblings=siblings)
    if chain in ("2-stage", "2-stage-unrelated", "3-stage"):  # (the n-gram drafter finds few continuations with
        # others beside them here; a transformers-forward stage verifies chains)
        assert sum(r.stats.stages[0].branch_accepted for r in requests) > 0
    if chain == "3-stage" and controller == "fixed":  # the middle stage's alternatives, taken by the target
        assert sum(r.stats.stages[1].branch_accepted for r in requests) > 0


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
def test_batched_draft_trees_with_requests_joining_and_leaving_match_target(models, prompts, reference, controller):
    """Trees and chains in the same target passes (the n-gram shortcut's chains, a drafter's trees), requests arriving,
    prefilling in chunks and being cancelled: every output is the target's greedy decode, and no cache is leaked."""
    rng = random.Random(11)
    params = RESTLESS if controller == "adaptive" else None
    engine = CascadeEngine(
        _stages(models, ["ngram", "close", "target"]), [3, 3], eos_token_id=EOS, controller=params, shortcut=True,
        max_running=6, max_batched_tokens=8, siblings=[0, 2, 0],
    )
    engine_small = CascadeEngine(
        _stages(models, ["small32", "target"]), [4], eos_token_id=EOS, controller=params, max_running=6,
        max_batched_tokens=8, siblings=[3, 0],
    )
    for engine in (engine, engine_small):
        submitted = []
        arrivals = list(range(len(prompts)))
        rng.shuffle(arrivals)
        while arrivals or engine.has_work:
            for _ in range(rng.choice([0, 1, 2])):
                if arrivals:
                    i = arrivals.pop()
                    submitted.append((i, engine.add_request(prompts[i], SamplingParams(), NEW_TOKENS)))
            running = [r for _, r in submitted if not r.finished]
            if running and rng.random() < 0.03:
                engine.finish(rng.choice(running), "abort")
            engine.step()
        for i, request in submitted:
            expected = reference[i]
            if request.finish_reason == "abort":
                assert request.generated == expected[: len(request.generated)]
            else:
                assert request.generated == expected, f"prompt {i}"
        assert all(s.num_cached_sequences() == 0 for s in engine.stages if hasattr(s, "num_cached_sequences"))
        if controller == "fixed":  # (the restless controller may draft little for the target from the models)
            assert sum(s.branch_accepted for _, r in submitted for s in r.stats.stages) > 0


def test_the_metrics_count_draft_tree_branches_as_the_request_stats_do(models, prompts, reference):
    """The server's Prometheus sink gets each tree's branch tokens and those accepted, per drafting stage, and they
    sum to the requests' own statistics."""
    from prometheus_client import generate_latest

    from cascade.server.metrics import Metrics

    stages = _stages(models, ["tiny16", "target"])
    metrics = Metrics([s.name for s in stages])
    engine = CascadeEngine(stages, [4], eos_token_id=EOS, observer=metrics, siblings=[2, 0])
    requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts[:8]]
    while engine.has_work:
        engine.step()
    assert [r.generated for r in requests] == reference[:8]
    text = generate_latest(metrics.registry).decode()

    def value(name):
        line = next(line for line in text.splitlines() if line.startswith(name + '{stage="tiny16"}'))
        return float(line.split()[-1])

    proposed = sum(r.stats.stages[0].branch_tokens for r in requests)
    accepted = sum(r.stats.stages[0].branch_accepted for r in requests)
    assert accepted > 0 and proposed > accepted
    assert value("cascade_spec_decode_num_tree_tokens_total") == proposed
    assert value("cascade_spec_decode_num_tree_accepted_tokens_total") == accepted
    # the sibling each branching path took, by rank: one of the two beside each token, counted alike in both
    ranks: dict[int, int] = {}
    for r in requests:
        for rank, n in r.stats.stages[0].branch_ranks.items():
            ranks[rank] = ranks.get(rank, 0) + n
    assert ranks and set(ranks) <= {1, 2}
    for rank, n in ranks.items():
        line = f'cascade_spec_decode_tree_branch_rank_total{{rank="{rank}",stage="tiny16"}}'
        assert float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1]) == n


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
def test_lookup_trees_commit_the_targets_greedy_decode(models, prompts, reference, controller):
    """The n-gram drafter's found continuations with their other continuations as branches (the shortcut straight to
    the target, and an n-gram drafting for the target alone): still the target's greedy decode, and branches taken."""
    params = RESTLESS if controller == "adaptive" else None
    setups = [(["ngram-consensus", "close", "target"], [4, 3], True), (["ngram-consensus", "target"], [5], False)]
    for chain, depths, shortcut in setups:
        stages = _stages(models, chain)
        engine = CascadeEngine(stages, depths, eos_token_id=EOS, controller=params, shortcut=shortcut, max_running=8,
                               siblings=[3] + [0] * (len(chain) - 1))
        requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts]
        while engine.has_work:
            engine.step()
        assert [r.generated for r in requests] == reference
        if controller == "fixed":  # (the restless controller takes few found continuations on these models)
            assert sum(r.stats.stages[0].branch_accepted for r in requests) > 0


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
def test_pipelined_draft_trees_commit_the_targets_greedy_decode(models, prompts, reference, controller):
    """Trees in the pipelined mode: the target verifies a tree while the stages below draft the next round ahead
    (kept only when the whole spine and the bonus were accepted); still the target's greedy decode."""
    run_each(models, prompts, reference, "2-stage", controller, pipeline=True, siblings=[2, 0])
    run_each(models, prompts, reference, "2-stage", controller, interrupt_ahead=False, pipeline=True, siblings=[2, 0])
