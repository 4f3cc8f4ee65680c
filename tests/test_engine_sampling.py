"""Sampling losslessness: a 3-stage cascade's tokens follow the target's exact distribution.

The vocabulary is small enough to enumerate, so the exact joint distribution of the first two tokens is computed
from the target alone and compared with the cascade's empirical one by a chi-square test at a fixed seed.
The drafts are chosen to be bad (rejections and recovered tokens happen often) and one of them puts zero
probability on some tokens.

Sample counts scale with ``CASCADE_TEST_SAMPLES`` (default 1; e.g. 0.25 for a quicker iteration, 4 for a stricter
check): every chi-square test here and in the modules that import :func:`samples` draws ``samples(n)`` requests.
What a test tolerates follows from its count. It fails an exact sampler with probability 1e-3 (the threshold
p > 1e-3) and catches, with probability 0.9, any sampler whose pair distribution q is at chi-square divergence
sum((q - p)^2 / p) >= :func:`detectable_divergence` from the exact p: 0.0045 at 20,000 samples over the 144 pairs of
this vocabulary, 0.011 at 8,000, 0.045 at 2,000 (a total variation of roughly half its square root or less).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from cascade.controller import ControllerParams
from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams, warp
from cascade.stages.draft import draft_tokens, draft_tree
from tests.conftest import hf_stage, perturbed_copy, random_llama

pytestmark = pytest.mark.slow  # chi-square tests of 20,000 samples each (test_penalties keeps one in the fast loop)

VOCAB = 12
PROMPT = [3, 7, 1]
SAMPLE_SCALE = float(os.environ.get("CASCADE_TEST_SAMPLES", "1"))


def samples(n: int) -> int:
    """``n`` chi-square samples scaled by ``CASCADE_TEST_SAMPLES``, never under 1,000 (below that the pooled cells
    dominate and the power checks lose their margin)."""
    if SAMPLE_SCALE <= 0:
        raise ValueError(f"CASCADE_TEST_SAMPLES must be positive, got {SAMPLE_SCALE}")
    return max(1000, round(n * SAMPLE_SCALE))


def detectable_divergence(num_samples: int, cells: int = VOCAB * VOCAB, power: float = 0.9) -> float:
    """The chi-square divergence from the exact distribution that a test of ``num_samples`` over ``cells`` cells
    detects with probability ``power`` at the suite's threshold p < 1e-3 (the noncentral chi-square's parameter,
    divided by the sample count)."""
    from scipy.optimize import brentq

    df = cells - 1
    critical = chi2.isf(1e-3, df)
    noncentrality = brentq(lambda lam: ncx2.sf(critical, df, lam) - power, 1e-6, 1e6)
    return noncentrality / num_samples


NUM_SAMPLES = samples(20_000)
MAX_TOKENS = 4  # longer than the two tokens tested, so the lower stages draft several tokens per round


class TableModel:
    """A random second-order Markov model as a stage: logits depend on the last two tokens (a fast stand-in for
    a transformer when tens of thousands of samples are needed; it implements the same ModelStage interface)."""

    def __init__(self, name: str, seed: int, scale: float = 1.5, banned: Sequence[int] = ()):
        generator = torch.Generator().manual_seed(seed)
        self.name = name
        self.vocab_size = VOCAB
        self.max_context = 1 << 20
        self.new_tokens = 0
        self.table = torch.randn(VOCAB, VOCAB, VOCAB, generator=generator) * scale  # [prev2, prev1, vocab]
        if banned:
            self.table[:, :, list(banned)] = float("-inf")  # this drafter never proposes these tokens

    def logits_after(self, context: Sequence[int]) -> torch.Tensor:
        return self.table[context[-2], context[-1]]  # [vocab]

    def score(self, seq_ids, contexts, num_positions):
        out = []
        self.new_tokens += sum(num_positions)
        for ctx, m in zip(contexts, num_positions):
            rows = [self.logits_after(ctx[: len(ctx) - m + 1 + j]) for j in range(m)]
            out.append(torch.stack(rows) if rows else torch.empty(0, VOCAB))  # [m, vocab] (m = 0: a prefill)
        return out

    def argmax(self, seq_ids, contexts, num_positions):
        return [logits.argmax(-1) for logits in self.score(seq_ids, contexts, num_positions)]

    def draft(self, seq_ids, contexts, depths, eos_token_ids, sampling):
        return draft_tokens(self, seq_ids, contexts, depths, eos_token_ids, sampling)

    scores_trees = True

    def draft_tree(self, seq_ids, contexts, depths, eos_token_ids, sampling, siblings):
        return draft_tree(self, seq_ids, contexts, depths, eos_token_ids, sampling, siblings)

    def score_tree(self, seq_ids, contexts, num_positions, trees):
        """Each tree node's row from its own path (a tree pass, as the lean forward computes it): the last ``m``."""
        out = []
        for ctx, m, tree in zip(contexts, num_positions, trees):
            if tree is None:
                out.extend(self.score([0], [ctx], [m]))
                continue
            paths = [[]]
            for token, parent in zip(tree.tokens, tree.parents):
                paths.append(paths[parent + 1] + [token])
            self.new_tokens += m
            out.append(torch.stack([self.logits_after(list(ctx) + path) for path in paths[len(paths) - m :]]))  # [m, vocab]
        return out

    def adopt(self, seq_id, prompt):
        return 0  # nothing is cached: every context is read afresh

    def release(self, seq_id):
        pass

    def num_cached_sequences(self):
        return 0

    def cached_tokens(self, seq_id):
        return 0


class MaskedStage:
    """Wraps a model stage so that it gives zero probability to some tokens."""

    def __init__(self, inner, banned: Sequence[int]):
        self.inner, self.banned = inner, list(banned)
        self.name, self.vocab_size, self.max_context = inner.name, inner.vocab_size, inner.max_context

    @property
    def new_tokens(self):
        return self.inner.new_tokens

    def score(self, seq_ids, contexts, num_positions):
        out = self.inner.score(seq_ids, contexts, num_positions)
        banned = torch.zeros(self.vocab_size, dtype=torch.bool)
        banned[self.banned] = True
        return [logits.masked_fill(banned, float("-inf")) for logits in out]

    def argmax(self, seq_ids, contexts, num_positions):
        return [logits.argmax(-1) for logits in self.score(seq_ids, contexts, num_positions)]

    def draft(self, seq_ids, contexts, depths, eos_token_ids, sampling):
        return draft_tokens(self, seq_ids, contexts, depths, eos_token_ids, sampling)

    def adopt(self, seq_id, prompt):
        return self.inner.adopt(seq_id, prompt)

    def release(self, seq_id):
        self.inner.release(seq_id)

    def num_cached_sequences(self):
        return self.inner.num_cached_sequences()

    def cached_tokens(self, seq_id):
        return self.inner.cached_tokens(seq_id)


def exact_first_two(next_logits, params: SamplingParams) -> torch.Tensor:
    """P(first token = a, second = b) under the warped target, by enumeration: [vocab, vocab]."""
    p1 = warp(next_logits(PROMPT)[None], params)[0]  # [vocab]
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        joint[a] = p1[a].double() * warp(next_logits(PROMPT + [a])[None], params)[0].double()
    return joint


DECOYS = [(SamplingParams(), [5, 1, 2, 9]), (SamplingParams(temperature=1.3, top_k=4), [2, 2])]


def sample_first_two(
    stages, depths, params: SamplingParams, num_samples: int = NUM_SAMPLES, controller=None, coupled: bool = False
) -> Counter:
    """The first two tokens of ``num_samples`` seeded requests, run 48 at a time in one batch, with other requests
    (greedy ones, other settings, other prompts) mixed in: batching must not change what a request samples."""
    return sample_pairs(stages, depths, params, num_samples, controller, coupled)[0]


def sample_pairs(
    stages, depths, params: SamplingParams, num_samples: int = NUM_SAMPLES, controller=None, coupled: bool = False,
    *, at: int = 0, max_tokens: int = MAX_TOKENS, pipeline: bool = False, batch: int = 48, siblings=(),
    finished: list | None = None,
) -> tuple[Counter, int]:
    """Tokens ``at`` and ``at + 1`` of ``num_samples`` seeded requests, batched with decoys as
    :func:`sample_first_two` (``batch`` requests at a time); and how many of the requests' rounds started from drafts
    made ahead (``pipeline``). ``siblings``: the engine's draft trees; ``finished``: gets the requests."""
    engine = CascadeEngine(stages, depths, eos_token_id=None, controller=controller, max_running=batch, pipeline=pipeline,
                           siblings=siblings)
    engine.interrupt_ahead = False  # drafts made ahead at their full depth whatever the timing: a deterministic test
    engine.ahead_outcomes = True  # for every outcome of a verification, as on separate devices
    requests = []
    for seed in range(num_samples):
        requests.append(engine.add_request(PROMPT, params, max_tokens, seed=seed, coupled=coupled))
        if seed % 8 == 0:
            decoy_params, decoy_prompt = DECOYS[seed // 8 % len(DECOYS)]
            engine.add_request(decoy_prompt, decoy_params, 1 + seed % 5, seed=seed)
    while engine.has_work:
        engine.step()
    if finished is not None:
        finished.extend(requests)
    return Counter(tuple(r.generated[at : at + 2]) for r in requests), sum(r.stats.kept_ahead for r in requests)


def exact_pair_after_two(next_logits, params: SamplingParams) -> torch.Tensor:
    """P(third token = a, fourth = b) under the warped target, by enumeration of the first two: [vocab, vocab]."""
    def p(ctx):
        return warp(next_logits(ctx)[None], params)[0].double()

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = p(PROMPT)
    for t1 in range(VOCAB):
        second = p(PROMPT + [t1])
        for t2 in range(VOCAB):
            third = first[t1] * second[t2] * p(PROMPT + [t1, t2])  # [vocab]
            for t3 in range(VOCAB):
                joint[t3] += third[t3] * p(PROMPT + [t1, t2, t3])
    return joint


def chi_square_p_value(counts: Counter, joint: torch.Tensor) -> float:
    """Chi-square goodness of fit, pooling cells whose expected count is below 5 into one."""
    total = sum(counts.values())
    expected = (joint.flatten() * total).tolist()
    observed = [counts.get((a, b), 0) for a in range(VOCAB) for b in range(VOCAB)]
    impossible = [i for i, e in enumerate(expected) if e == 0]
    if any(observed[i] for i in impossible):
        return 0.0  # a pair the distribution gives probability 0 was sampled
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i, e in enumerate(expected) if 0 < e < 5]
    obs = [observed[i] for i in big] + ([sum(observed[i] for i in small)] if small else [])
    exp = [expected[i] for i in big] + ([sum(expected[i] for i in small)] if small else [])
    scale = sum(obs) / sum(exp)  # float rounding of the enumerated probabilities
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


SETTINGS = {
    "temperature-1.0": SamplingParams(temperature=1.0),
    "temperature-0.7-top-k-5": SamplingParams(temperature=0.7, top_k=5),
    "top-p-0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "min-p-0.15": SamplingParams(temperature=1.2, min_p=0.15),
}


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_three_stage_matches_target_distribution(setting):
    params = SETTINGS[setting]
    target = TableModel("target", seed=0)
    # Medium: the target's table plus noise (agrees often). Bottom: unrelated and banned from 3 tokens (bad draft).
    medium = TableModel("medium", seed=0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.7
    bottom = TableModel("bottom", seed=1, banned=[0, 4, 8])
    counts = sample_first_two([bottom, medium, target], [3, 2], params)
    joint = exact_first_two(target.logits_after, params)
    assert chi_square_p_value(counts, joint) > 1e-3
    # The test has power: the same samples are clearly not distributed like the medium drafter.
    assert chi_square_p_value(counts, exact_first_two(medium.logits_after, params)) < 1e-6


@pytest.mark.parametrize("coupled", [False, True], ids=["independent", "coupled"])
def test_pipelined_three_stage_matches_target_distribution(coupled):
    """The pipelined mode: the stages below draft the next round while the target verifies, and a round starts
    from those drafts when the target accepted everything and its bonus token is the first token drafted ahead.
    With the target's depth 1, the first round commits two tokens and the second may start from drafts made ahead,
    so tokens three and four are where such drafts are verified (checked against the exact enumeration). (Drafting
    ahead stopped early by the target's pass gives a draft whose length depends only on the rounds done, a stopping
    time: exact by the same argument; the coupled test below runs it.)"""
    params = SamplingParams(temperature=1.0)
    bottom, medium, target = _table_family()
    finished = []
    counts, kept = sample_pairs([bottom, medium, target], [3, 1], params, coupled=coupled, at=2, max_tokens=4,
                                pipeline=True, finished=finished)
    assert kept > NUM_SAMPLES // 10  # rounds really started from drafts made ahead
    # and from drafts made for an outcome where the target rejected the draft (its token the drafter's guess)
    assert sum(r.stats.kept_ahead_rejected for r in finished) > NUM_SAMPLES // 20
    assert chi_square_p_value(counts, exact_pair_after_two(target.logits_after, params)) > 1e-3
    assert chi_square_p_value(counts, exact_pair_after_two(medium.logits_after, params)) < 1e-6


def test_pipelined_seeded_request_reproduces_when_drafting_ahead_to_full_depth():
    """``interrupt_ahead = False``: the drafting ahead always reaches its depth, so a seeded request (independent
    sampling, fixed plan) samples the same tokens run after run, batched with others or alone."""
    params = SamplingParams(temperature=1.0)
    bottom, medium, target = _table_family()
    runs = []
    for others in (0, 5, 0):
        engine = CascadeEngine([bottom, medium, target], [3, 1], eos_token_id=None, pipeline=True)
        engine.interrupt_ahead = False
        engine.ahead_outcomes = True
        requests = [engine.add_request(PROMPT, params, 24, seed=seed) for seed in range(8)]
        for seed in range(others):
            engine.add_request([5, 1, 2], params, 1 + seed, seed=100 + seed)
        while engine.has_work:
            engine.step()
        assert sum(r.stats.kept_ahead for r in requests) > 0
        runs.append([r.generated for r in requests])
    assert runs[0] == runs[1] == runs[2]


def test_three_stage_adaptive_matches_target_distribution():
    """Depths and the chain change between rounds (and between requests, through the shared statistics)."""
    params = SamplingParams(temperature=1.0)
    target = TableModel("target", seed=0)
    medium = TableModel("medium", seed=0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.7
    bottom = TableModel("bottom", seed=1, banned=[0, 4, 8])
    restless = ControllerParams(warmup_rounds=0, hysteresis=0.0, explore_every=2, max_depth=4)
    counts = sample_first_two([bottom, medium, target], [3, 2], params, controller=restless)
    assert chi_square_p_value(counts, exact_first_two(target.logits_after, params)) > 1e-3


def test_three_stage_transformers_matches_target_distribution():
    """The same check with real (random) Llama models, whose KV caches are cropped after every rejection."""
    params = SamplingParams(temperature=1.0)
    target = random_llama(VOCAB, 16, 1, seed=0, init_range=0.5)
    medium = perturbed_copy(target, 0.3, seed=1)
    bottom = MaskedStage(hf_stage("bottom", random_llama(VOCAB, 16, 1, seed=2, init_range=0.5)), banned=[0, 5])
    stages = [bottom, hf_stage("medium", medium), hf_stage("target", target)]
    # 10,000 samples (~1 minute): the 20,000-sample tests above cover the three settings with table models.
    counts = sample_first_two(stages, [3, 2], params, num_samples=samples(10_000))

    @torch.inference_mode()
    def next_logits(ctx):
        return target(input_ids=torch.tensor([ctx])).logits[0, -1]

    assert chi_square_p_value(counts, exact_first_two(next_logits, params)) > 1e-3


def test_ngram_shortcut_matches_target_distribution():
    """n-gram drafts (one-hot) straight to the target on a match, the medium model's drafts otherwise."""
    from cascade.stages.ngram import NGramDrafter

    params = SamplingParams(temperature=1.0)
    target = TableModel("target", seed=0)
    medium = TableModel("medium", seed=0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.7
    engine_stages = [NGramDrafter(max_ngram=2, match="consensus"), medium, target]
    engine = CascadeEngine(engine_stages, [3, 2], eos_token_id=None, shortcut=True, max_running=48)
    requests = [engine.add_request(PROMPT, params, MAX_TOKENS, seed=seed) for seed in range(NUM_SAMPLES)]
    while engine.has_work:
        engine.step()
    counts = Counter(tuple(r.generated[:2]) for r in requests)
    direct = sum(r.stats.chains.get("ngram+target", 0) for r in requests)
    assert direct > NUM_SAMPLES // 20  # the shortcut was really taken
    assert chi_square_p_value(counts, exact_first_two(target.logits_after, params)) > 1e-3


def test_ngram_trees_match_target_distribution():
    """A prompt whose tail recurs with different continuations: the n-gram drafter proposes the consensus and, as
    branches, the others (deterministic candidates, each tested against the residual the ones before it left). The
    first two tokens still follow the target, and branches were really taken."""
    from cascade.stages.ngram import NGramDrafter

    params = SamplingParams(temperature=1.0)
    target = TableModel("target", seed=0)
    prompt = [3, 7, 1, 5, 3, 7, 2, 9, 3, 7, 1, 6, 3, 7]  # after (3, 7): 1, 2, 1; the consensus is 1, 2 a branch
    engine = CascadeEngine([NGramDrafter(max_ngram=2, match="consensus"), target], [3], eos_token_id=None,
                           siblings=[3, 0], max_running=48)
    requests = [engine.add_request(prompt, params, MAX_TOKENS, seed=seed) for seed in range(NUM_SAMPLES)]
    while engine.has_work:
        engine.step()
    assert sum(r.stats.stages[0].branch_accepted for r in requests) > NUM_SAMPLES // 20
    p1 = warp(target.logits_after(prompt)[None], params)[0].double()
    joint = torch.stack([p1[a] * warp(target.logits_after(prompt + [a])[None], params)[0].double() for a in range(VOCAB)])
    counts = Counter(tuple(r.generated[:2]) for r in requests)
    assert chi_square_p_value(counts, joint) > 1e-3
    # power: the same samples are clearly not the target's distribution after another prompt
    assert chi_square_p_value(counts, exact_first_two(target.logits_after, params)) < 1e-6


# ---- shared-noise (coupled) verification: seeded requests ----------------------------------------------------


def _table_family():
    target = TableModel("target", seed=0)
    medium = TableModel("medium", seed=0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.7
    bottom = TableModel("bottom", seed=1, banned=[0, 4, 8])
    return bottom, medium, target


@pytest.mark.parametrize("setting", ["temperature-1.0", "top-p-0.8"])
def test_coupled_three_stage_adaptive_matches_target_distribution(setting):
    """Drafts accepted only where they equal the verifier's own sample under the shared noise: still exact."""
    params = SETTINGS[setting]
    bottom, medium, target = _table_family()
    restless = ControllerParams(warmup_rounds=0, hysteresis=0.0, explore_every=2, max_depth=4)
    counts = sample_first_two([bottom, medium, target], [3, 2], params, controller=restless, coupled=True)
    assert chi_square_p_value(counts, exact_first_two(target.logits_after, params)) > 1e-3
    assert chi_square_p_value(counts, exact_first_two(medium.logits_after, params)) < 1e-6


def test_coupled_text_is_a_function_of_seed_prompt_and_target():
    """The same seeded request gives the same tokens alone on the target, through any chain and depths, under the
    adaptive controller, with the n-gram shortcut, pipelined, and batched among other requests — and another seed
    mostly gives other tokens."""
    from cascade.stages.ngram import NGramDrafter

    params = SamplingParams(temperature=0.9, top_k=8)
    bottom, medium, target = _table_family()
    restless = ControllerParams(warmup_rounds=0, hysteresis=0.0, explore_every=2, max_depth=4)
    setups = {
        "target alone": ([target], [], {}),
        "bottom+target": ([bottom, target], [4], {}),
        "bottom+medium+target": ([bottom, medium, target], [3, 2], {}),
        "adaptive": ([bottom, medium, target], [1, 5], {"controller": restless}),
        "ngram shortcut": ([NGramDrafter(max_ngram=2), medium, target], [3, 2], {"shortcut": True}),
        # drafted ahead while the target verifies, stopped when its pass is done (whatever the timing)
        "pipelined": ([bottom, medium, target], [3, 1], {"pipeline": True}),
        "pipelined adaptive": ([bottom, medium, target], [1, 5], {"controller": restless, "pipeline": True}),
    }
    prompts = [PROMPT, [1, 1, 2, 1, 1, 2, 1], [9, 4]]
    texts = {}
    for name, (stages, depths, options) in setups.items():
        engine = CascadeEngine(stages, depths, eos_token_id=None, max_running=16, **options)
        requests = {}
        for seed in range(24):
            prompt = prompts[seed % len(prompts)]
            requests[seed] = engine.add_request(prompt, params, 12, seed=seed, coupled=True)
            engine.add_request(prompt, SamplingParams(temperature=1.3), 1 + seed % 7, seed=seed)  # unseeded-style
        while engine.has_work:
            engine.step()
        texts[name] = {seed: r.generated for seed, r in requests.items()}
    reference = texts.pop("target alone")
    for name, got in texts.items():
        assert got == reference, name
    firsts = Counter(tuple(reference[s]) for s in range(0, 24, 3))  # one prompt, eight seeds
    assert len(firsts) >= 6


@pytest.mark.parametrize("setting,siblings", [("top-p-0.8", [2, 0]), ("temperature-1.0", [2, 2, 0])])
def test_draft_trees_match_target_distribution(setting, siblings):
    """A drafter's tree — its sampled draft with its two likeliest other tokens beside each draft token — verified by
    recursive rejection over the siblings: tokens 3 and 4 (after rounds that often ended on a branch) follow the
    target, batched with decoys (chains); branches were really taken. With three stages the bottom's tree goes to the
    middle stage, whose path through it (and the rows each of its tokens was drawn from) goes up as its draft for the
    target, a tree too: its two next likeliest tokens beside each of its tokens.
    (The unrelated bottom drafter: its draft is often wrong and its runner-up right. The adaptive controller is not
    used here: on these table models it finds drafting does not pay and hardly drafts.)"""
    params = SETTINGS[setting]
    bottom, medium, target = _table_family()
    stages, depths = ([bottom, target], [3]) if len(siblings) == 2 else ([bottom, medium, target], [3, 3])
    requests: list = []
    counts, _ = sample_pairs(stages, depths, params, at=2, max_tokens=5, siblings=siblings, finished=requests)
    for drafter in range(len(stages) - 1):
        assert sum(r.stats.stages[drafter].branch_accepted for r in requests) > len(requests) // 20
    assert chi_square_p_value(counts, exact_pair_after_two(target.logits_after, params)) > 1e-3
    assert chi_square_p_value(counts, exact_pair_after_two(stages[-2].logits_after, params)) < 1e-6


def test_coupled_text_is_unchanged_by_draft_trees():
    """A seeded request's text is a function of seed, prompt and target: the same with trees on as off, whether the
    bottom model's trees go to the target or to a middle stage, and with a middle stage's trees for the target."""
    params = SamplingParams(temperature=0.9, top_k=8)
    bottom, medium, target = _table_family()
    texts = []
    setups = [([bottom, target], [4], [0, 0]), ([bottom, target], [4], [2, 0]), ([bottom, target], [4], [3, 0]),
              ([bottom, medium, target], [3, 2], [2, 0, 0]), ([bottom, medium, target], [3, 2], [2, 2, 0])]
    for stages, depths, siblings in setups:
        engine = CascadeEngine(stages, depths, eos_token_id=None, max_running=16, siblings=siblings)
        requests = [engine.add_request(PROMPT, params, 12, seed=seed, coupled=True) for seed in range(24)]
        while engine.has_work:
            engine.step()
        texts.append([r.generated for r in requests])
        if siblings[0]:
            assert sum(r.stats.stages[0].branch_accepted for r in requests) > 0
    assert all(text == texts[0] for text in texts[1:])
