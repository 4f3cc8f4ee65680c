"""The adaptive controller against synthetic acceptance sequences and cost curves."""

from __future__ import annotations

import itertools

import pytest
import torch

from cascade.controller import (
    AdaptiveController,
    ControllerParams,
    CostFit,
    GlobalStats,
    Plan,
    candidate_chains,
    expected_tokens,
)
from cascade.controller.checks import load_bucket

CHECK_STEPS = ControllerParams().check_steps


def brute_force(alpha, cost, model_free, max_depth=8):
    """Every chain and every depth vector, throughput by the formula written out directly."""
    n = len(cost)
    best = (0.0, None, None)
    for mask in range(1 << (n - 1)):
        chain = [i for i in range(n - 1) if mask >> i & 1] + [n - 1]
        for depths in itertools.product(range(1, max_depth + 1), repeat=len(chain) - 1):
            # time for chain[p] to produce k tokens, built from the bottom
            def produce(p, k):
                s = chain[p]
                if p == 0:
                    return cost[s](1) if model_free[s] else k * cost[s](1)
                d = depths[p - 1]
                per_round = produce(p - 1, d) + cost[s](d + 1)
                return k * per_round / expected_tokens(alpha[(chain[p - 1], s)], d)

            if len(chain) == 1:
                rate = 1.0 / cost[chain[0]](1)
            else:
                k = depths[-1]
                rate = expected_tokens(alpha[(chain[-2], chain[-1])], k) / (produce(len(chain) - 2, k) + cost[chain[-1]](k + 1))
            if rate > best[0]:
                best = (rate, tuple(chain), tuple(depths))
    return best


def linear(a, b):
    return lambda t: a + b * t


def simulate(controller, alpha, cost, rounds, steps=True, checks=None, log=None):
    """Run rounds: the controller plans, the synthetic cascade reports noise-free observations, and each round is
    one engine step of one request, observed as the engine observes its steps (committed tokens, seconds, whether
    the models drafted); ``steps=False`` leaves the steps unobserved, to test the model's predictions alone.
    ``checks``: a list that gets, per round, whether it ran in a check of the observed rates; ``log``: one that gets,
    per round, its plan and whether it explored."""
    plans = []
    for _ in range(rounds):
        plan = controller.decide()
        if checks is not None:
            checks.append(controller.global_stats.checked)
        if not controller.explored:
            plans.append(plan)  # the controller's choices; exploration rounds are not choices
        if log is not None:
            log.append((plan, controller.explored))
        seconds = 0.0
        if len(plan.chain) == 1:  # the target alone: a plain pass
            seconds = cost[plan.chain[0]](1)
            controller.global_stats.observe_pass(plan.chain[0], 1, seconds, plain=True)
        for p in range(1, len(plan.chain)):
            drafter, verifier = plan.chain[p - 1], plan.chain[p]
            d = plan.depths[p - 1]
            controller.observe_round(drafter, verifier, d, 0, expected=alpha[(drafter, verifier)] * d)
            controller.global_stats.observe_pass(verifier, d + 1, cost[verifier](d + 1))
            controller.global_stats.observe_pass(drafter, 1, cost[drafter](1), plain=p == 1)
            seconds += cost[verifier](d + 1) + d * cost[drafter](1) * (p == 1)
        tokens = expected_tokens(alpha[plan.chain[-2:]], plan.depths[-1]) if len(plan.chain) > 1 else 1.0
        if steps:
            drafted = None if controller.explored else len(plan.chain) > 1
            controller.global_stats.drafting.observe(1, drafted, tokens, seconds)
    return plans


def make(cost, model_free, initial_chain, initial_depths, **params):
    stats = GlobalStats(len(cost), ControllerParams(**params))
    return AdaptiveController(stats, model_free, Plan(initial_chain, initial_depths, 0.0), ControllerParams(**params))


COSTS = {
    0: linear(2e-5, 1e-6),  # n-gram lookup: nearly free
    1: linear(0.6e-3, 0.05e-3),  # small model
    2: linear(1.1e-3, 0.1e-3),  # medium model
    3: linear(4.5e-3, 0.15e-3),  # target
}


@pytest.mark.parametrize(
    "alphas",
    [
        {"01": 0.5, "12": 0.8, "23": 0.75, "02": 0.4, "03": 0.35, "13": 0.65},
        {"01": 0.2, "12": 0.6, "23": 0.9, "02": 0.1, "03": 0.1, "13": 0.85},
        {"01": 0.9, "12": 0.9, "23": 0.9, "02": 0.85, "03": 0.8, "13": 0.85},
    ],
)
def test_converges_to_the_brute_force_optimum(alphas):
    alpha = {(int(k[0]), int(k[1])): v for k, v in alphas.items()}
    alpha[(0, 1)] = alphas["01"]
    model_free = [True, False, False, False]
    ctl = make(COSTS, model_free, (0, 1, 2, 3), (4, 4, 4), explore_every=5, hysteresis=0.0)
    simulate(ctl, alpha, COSTS, 400)
    rate, chain, depths = brute_force(alpha, COSTS, model_free)
    final = ctl.current
    assert final.chain == chain and final.depths == depths, (final, chain, depths)
    assert final.throughput == pytest.approx(rate, rel=0.02)
    # With hysteresis the controller may keep a plan that is within the hysteresis of the best.
    sticky = make(COSTS, model_free, (0, 1, 2, 3), (4, 4, 4), explore_every=5, hysteresis=0.05)
    simulate(sticky, alpha, COSTS, 400)
    assert sticky.current.throughput >= rate / 1.05 * 0.999


def test_adapts_quickly_when_acceptance_drops():
    cost = {0: COSTS[1], 1: COSTS[3]}
    alpha = {(0, 1): 0.95}
    ctl = make(cost, [False, False], (0, 1), (2,), explore_every=0)
    simulate(ctl, alpha, cost, 100)
    assert ctl.current.depths[0] >= 6  # high acceptance: draft deep
    alpha[(0, 1)] = 0.3
    plans = simulate(ctl, alpha, cost, 40)
    _, _, depths = brute_force(alpha, cost, [False, False])
    settled = [i for i, p in enumerate(plans) if p.depths == depths]
    assert settled and settled[0] < 25  # within 25 rounds of the change
    assert all(p.depths == depths for p in plans[settled[0]:])


def test_bypasses_a_useless_stage_and_brings_it_back():
    cost = {0: COSTS[1], 1: COSTS[2], 2: COSTS[3]}
    model_free = [False, False, False]
    alpha = {(0, 1): 0.01, (0, 2): 0.01, (1, 2): 0.8}
    ctl = make(cost, model_free, (0, 1, 2), (4, 4), explore_every=8)
    simulate(ctl, alpha, cost, 150)
    assert ctl.current.chain == (1, 2)  # the useless small model is out
    alpha.update({(0, 1): 0.97, (0, 2): 0.9})  # the small model starts agreeing
    plans = simulate(ctl, alpha, cost, 120)
    _, chain, depths = brute_force(alpha, cost, model_free)
    assert 0 in chain  # it pays again ...
    back = next(i for i, p in enumerate(plans) if p.chain == chain)
    assert back < 100  # ... and exploration (backed off to one round per 8 × 8 by then) brings it back
    assert (ctl.current.chain, ctl.current.depths) == (chain, depths)


def test_restricted_chains_are_the_only_ones_planned_or_explored():
    """Under the n-gram shortcut the engine plans only the chains without the n-gram drafter."""
    alpha = {(0, 1): 0.9, (0, 2): 0.9, (0, 3): 0.9, (1, 2): 0.3, (1, 3): 0.6, (2, 3): 0.5}
    model_free = [True, False, False, False]
    chains = ((3,), (1, 3), (2, 3), (1, 2, 3))
    stats = GlobalStats(4, ControllerParams(explore_every=3, hysteresis=0.0))
    ctl = AdaptiveController(stats, model_free, Plan((1, 2, 3), (4, 4), 0.0), stats.params, chains)
    rounds = []
    simulate(ctl, alpha, COSTS, 200, log=rounds)
    seen = {plan.chain for plan, _ in rounds}
    explored = sum(exploring for _, exploring in rounds)
    assert explored > 0
    assert seen <= set(chains) and len(seen) > 1  # explored several, never one with the n-gram drafter
    assert all(ctl.global_stats.pair_alpha(0, j) is None for j in (1, 2, 3))
    # With the n-gram drafter's pairs worthless, the unrestricted optimum is one of the allowed chains.
    _, chain, depths = brute_force({**alpha, (0, 1): 0.0, (0, 2): 0.0, (0, 3): 0.0}, COSTS, model_free)
    assert (ctl.current.chain, ctl.current.depths) == (chain, depths)


def test_exploration_backs_off_while_it_changes_nothing():
    """A stage that keeps proving useless is explored ever less often (down to one round per 8 × explore_every);
    once an exploration changes a chain, the interval is explore_every again."""
    cost = {0: COSTS[1], 1: COSTS[2], 2: COSTS[3]}
    alpha = {(0, 1): 0.01, (0, 2): 0.01, (1, 2): 0.8}
    ctl = make(cost, [False, False, False], (0, 1, 2), (4, 4), explore_every=8)
    simulate(ctl, alpha, cost, 150)
    assert ctl.current.chain == (1, 2)

    def explorations(rounds: int) -> list[int]:
        at = []
        for r in range(rounds):
            simulate(ctl, alpha, cost, 1)
            if ctl.explored:
                at.append(r)
        return at

    useless = explorations(1000)
    assert len(useless) <= 1000 // 64 + 2  # a fixed interval would explore 125 times
    assert min(b - a for a, b in zip(useless, useless[1:])) >= 64
    alpha.update({(0, 1): 0.97, (0, 2): 0.9})  # the small model starts agreeing: an exploration brings it back
    useful = explorations(300)
    assert ctl.current.chain[0] == 0
    assert any(b - a <= 8 for a, b in zip(useful, useful[1:]))  # and exploration is frequent again


def test_plain_decoding_is_weighed_by_its_own_cost_curve():
    """A pass that verifies drafts costs a fixed amount more than one that only decodes (its verification, the
    drafts' own attention call). Weighing plain decoding by the verifying curve would make speculation look better
    than it is; with both curves the controller decodes plainly, as the true rates say it should."""
    drafter, target = linear(0.5e-3, 0.0), linear(2.0e-3, 0.0)  # plain passes
    verifying = linear(3.0e-3, 0.3e-3)  # the target verifying t positions
    alpha = 0.6
    spec = max(expected_tokens(alpha, k) / (k * drafter(1) + verifying(k + 1)) for k in range(1, 9))
    assert 1 / verifying(1) < spec < 1 / target(1)  # plain decoding is best; priced as a verifying pass it is not
    ctl = make({0: drafter, 1: target}, [False, False], (0, 1), (4,))
    for _ in range(200):
        plan = ctl.decide()
        if len(plan.chain) == 1:
            ctl.global_stats.observe_pass(1, 1, target(1), plain=True)
        else:
            d = plan.depths[0]
            ctl.observe_round(0, 1, d, 0, expected=alpha * d)
            ctl.global_stats.observe_pass(1, d + 1, verifying(d + 1))
            ctl.global_stats.observe_pass(0, 1, drafter(1), plain=True)
    assert ctl.current.chain == (1,)


def test_warmup_keeps_the_configured_plan():
    ctl = make(COSTS, [True, False, False, False], (0, 1, 2, 3), (4, 4, 4), warmup_rounds=3)
    assert [ctl.decide() for _ in range(3)] == [ctl.initial] * 3


def test_cost_fit_recovers_a_line():
    fit = CostFit()
    for t in [1, 3, 5, 9, 2, 7] * 5:
        fit.add(t, 0.002 + 0.0003 * t)
    assert fit(1) == pytest.approx(0.0023) and fit(10) == pytest.approx(0.005)
    single = CostFit()
    single.add(1, 0.004)
    assert single(1) == pytest.approx(0.004)


def test_cost_fit_keeps_its_slope_under_a_steady_load():
    """After a ramp through every batch size, hundreds of passes at one token count (a steady load, measured with
    noise) must not flatten the curve: extra tokens keep costing what they cost."""
    fit = CostFit()
    for t in range(1, 33):
        fit.add(t, 0.002 + 0.0005 * t)
    noise = torch.Generator().manual_seed(0)
    for _ in range(500):
        fit.add(16, (0.002 + 0.0005 * 16) * (1 + 0.2 * (torch.rand((), generator=noise).item() - 0.5)))
    assert (fit(32) - fit(16)) / 16 == pytest.approx(0.0005, rel=0.25)
    assert fit(16) == pytest.approx(0.010, rel=0.05)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # a tree: a rejecting round (probability 1 - α^k) gains a token where a branch takes over (ρ)
    assert expected_tokens(0.5, 2, rescue=0.4) == pytest.approx(1.75 + 0.4 * 0.75)


def test_draft_trees_are_planned_by_what_their_branches_add_and_their_nodes_cost():
    """A level's draft trees yield E(α, d) + ρ·(1 − α^d) tokens a round for a verifying pass over d + 1 + width·d
    positions: worth it, and worth deeper drafts, where those positions are nearly free (a memory-bound target);
    not where each costs its share of the pass. Through the controller: ρ is observed from the tree rounds whose draft
    was rejected, and counted only while the regime's steps run trees."""
    from cascade.controller import plan_chain
    from cascade.controller.model import TreeTerms

    def draft_cost(t):
        return 0.001

    def flat(t):  # memory-bound: flat up to 64 positions
        return 0.040 * max(1.0, t / 64)

    def steep(t):
        return 0.004 + 0.004 * t

    alpha, tree = 0.6, TreeTerms(rescue=0.7, width=2)
    for target_cost, pays in ((flat, True), (steep, False)):
        costs = [draft_cost, target_cost]
        chain = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8)
        treed = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8, trees=[TreeTerms(), tree])
        k = treed.depths[-1]
        assert treed.throughput == pytest.approx(
            expected_tokens(alpha, k, 0.7) / (k * 0.001 + target_cost(k + 1 + 2 * k)))
        assert (treed.throughput > chain.throughput) is pays
    # through the controller: the rounds' rescues, counted while trees run
    stats = GlobalStats(2)
    controller = AdaptiveController(stats, [False, False], Plan((0, 1), (4,), 0.0), tree_widths={(0, 1): 2})
    for branched in (1, 2, 0, 3):  # four rejected tree drafts, three taken over by a branch
        controller.observe_round(0, 1, 4, 1, branched=branched)
    controller.observe_round(0, 1, 4, 4, branched=0)  # accepted whole: says nothing of branches
    controller.observe_round(0, 1, 4, 0)  # a chain
    assert stats.pair_rescue(0, 1) == pytest.approx(0.75, abs=0.01)  # (a decayed mean)
    assert controller.pair_tree(0, 1) == TreeTerms()  # the regime's steps do not run trees
    stats.treeing = True
    assert controller.pair_tree(0, 1) == TreeTerms(stats.pair_rescue(0, 1), 2)


@pytest.mark.parametrize("batch", [1, 16])
def test_found_continuations_are_declined_while_steps_without_them_run_faster(batch):
    """Found continuations are taken while the engine's steps that verify them run at least as fast as the steps
    that verify none, at this load; declined once they are observed slower (at a sampling temperature one-hot
    guesses are mostly rejected), with a check of a few steps taking them again now and then, and taken again once a
    check sees them pay. Whole steps are compared, not a request's own rounds: under load a request's continuation
    makes every request of the step wait (measured at four clients, T = 0.8: their steps ran at 840 tokens/s
    against 1,040 without, while each request's own rounds looked faster with them)."""
    params = ControllerParams(check_every=8, explore_budget=1.0)
    stats = GlobalStats(3, params)
    ctl = AdaptiveController(stats, [True, False, False], Plan((1, 2), (4,), 0.0), params, ((2,), (1, 2)))
    rates = {True: (5 * batch, 0.010), False: (2 * batch, 0.008)}  # (tokens, seconds) per step: 500 and 250 per request

    def run(steps):
        taken = []
        for i in range(steps):
            lookup = all([ctl.take_lookup(batch) for _ in range(batch)])  # every request of a step alike
            taken.append(lookup)
            found = lookup and i % 5 != 0  # in one step in five no request finds a continuation
            stats.lookups.observe(batch, found, *rates[found])
        return taken

    first = run(50)
    # a check observes steps without them: they pay; later checks confirm it, less and less often (8, 16 steps)
    assert [i for i, taken in enumerate(first) if not taken] == [7, 8, 9, 17, 18, 19, 35, 36, 37]
    rates[True] = (batch, 0.009)  # they stop paying
    settled = run(300)[100:]
    assert 0 < sum(settled) <= len(settled) // 8  # declined, but checked now and then
    rates[True] = (6 * batch, 0.010)  # they pay again: the checks bring them back
    assert run(200)[150:].count(False) <= CHECK_STEPS  # taken, but for a check


def _warm_controller(target_verify, target_plain, **params):
    """A two-stage (n-gram drafter, target) controller past its warm-up, with the target's cost curves measured."""
    params = ControllerParams(**params)
    stats = GlobalStats(2, params)
    ctl = AdaptiveController(stats, [True, False], Plan((1,), (), 0.0), params, ((1,),))
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        stats.observe_pass(1, t, target_verify(t), plain=False)
        stats.observe_pass(1, t, target_plain(t), plain=True)
    for _ in range(params.warmup_rounds + 1):
        ctl.decide()
    return ctl


def test_found_continuations_are_judged_by_what_they_add_to_the_step():
    """A found continuation is worth its tokens at one request, but under load its extra positions delay every
    request of the step by more than it gains: declined there (its own tokens over the step's seconds would look
    better than a plain round's, since the step's seconds are shared)."""
    ctl = _warm_controller(linear(10e-3, 0.5e-3), linear(8e-3, 0.5e-3))
    for _ in range(20):
        ctl.observe_round(0, 1, 4, 0, expected=0.6 * 4)  # α = 0.6 given a match
    alone = ctl.lookup_value(batch=1, step_tokens=1)
    assert alone.depth >= 2 and alone.gain(alone.depth) > alone.threshold
    loaded = ctl.lookup_value(batch=64, step_tokens=64)
    assert loaded.depth == 0 and loaded.gain(1) < 0
    # A step that verifies anyway (its requests' models draft) does not charge the continuation for verifying.
    assert loaded.threshold > 0


SMALL = linear(0.5e-3, 0.01e-3)  # a small model's passes
TARGET_VERIFY, TARGET_PLAIN = linear(2e-3, 0.15e-3), linear(1.8e-3, 0.15e-3)  # the target's, verifying and plain


def _drafting_controller(lookup_alpha: float) -> AdaptiveController:
    """A controller of (n-gram drafter, small model, target) past its warm-up, planning small -> target at depth 8
    (α = 0.9), with found continuations accepted at ``lookup_alpha`` given a match."""
    params = ControllerParams(explore_every=0)
    stats = GlobalStats(3, params)
    for t in (1, 2, 4, 8, 9, 16, 64, 128, 256, 512, 1024):
        stats.observe_pass(2, t, TARGET_VERIFY(t), plain=False)
        stats.observe_pass(2, t, TARGET_PLAIN(t), plain=True)
        stats.observe_pass(1, t, SMALL(t), plain=True)
    stats.observe_pass(0, 1, 1e-5, plain=True)
    ctl = AdaptiveController(stats, [True, False, False], Plan((1, 2), (8,), 0.0), params, ((2,), (1, 2)))
    for _ in range(40):
        ctl.observe_round(1, 2, 8, 0, expected=0.9 * 8)
        ctl.observe_round(0, 2, 8, 0, expected=lookup_alpha * 8)
    for _ in range(2):  # the plain steps a new load runs first
        stats.drafting.observe(1, False, 1, TARGET_PLAIN(1))
    for _ in range(params.warmup_rounds + 1):
        assert ctl.decide().chain == (1, 2)
    return ctl


def test_a_continuation_found_for_a_lone_request_is_worth_the_drafting_it_skips():
    """At one request a found continuation replaces a whole round of the plan, its drafters' passes included: it
    is taken where its rate beats the plan's, E_L / c(d + 1) > E_plan / T_plan, even though it commits fewer tokens
    per round than the plan's drafts. Under load a request's share of a batched drafter pass is small and the same
    continuation does not pay. (Charged only the positions it adds, as if the drafting ran anyway, it was declined:
    measured, the shipped config then drafted with the small model at 850 tokens/s where continuations ran at
    1,900.)"""
    ctl = _drafting_controller(lookup_alpha=0.7)
    value = ctl.lookup_value(batch=1, step_tokens=9)
    plan_rate = expected_tokens(0.9, 8) / (8 * SMALL(1) + TARGET_VERIFY(9))
    assert expected_tokens(0.7, 8) < expected_tokens(0.9, 8)  # fewer tokens per round ...
    assert expected_tokens(0.7, 8) / TARGET_VERIFY(9) > 1.1 * plan_rate  # ... at a better rate
    assert value.depth >= 4 and value.gain(value.depth) > 0
    loaded = ctl.lookup_value(batch=64, step_tokens=64 * 9)
    assert loaded.gain(8) < 0


def test_drafting_observed_slower_than_plain_decoding_at_this_load_gives_way():
    """The model predicts that drafting pays; the engine's steps say it does not at this load: the target decodes
    alone, with one step in check_every drafting again, less often while checks confirm it; at another load the
    model's plan stands; once drafting steps are faster, drafting is back."""
    costs = {0: linear(0.5e-3, 0.05e-3), 1: linear(10e-3, 0.01e-3)}  # a cheap drafter, a bandwidth-bound target
    ctl = make(costs, [False, False], (0, 1), (4,), explore_every=0, check_every=4)
    simulate(ctl, {(0, 1): 0.8}, costs, 20)
    assert ctl.decide(batch=16).chain == (1,)  # a new load: plain steps first, which measure the target there
    stats = ctl.global_stats
    for _ in range(8):
        stats.drafting.observe(16, True, 30, 0.040)  # drafting steps: 750 tokens/s
    for _ in range(8):
        stats.drafting.observe(16, False, 16, 0.016)  # plain steps: 1,000 tokens/s
    chains = []
    for _ in range(60):
        chains.append(ctl.decide(batch=16).chain)
        drafted = len(chains[-1]) > 1
        stats.drafting.observe(16, drafted, 30 if drafted else 16, 0.040 if drafted else 0.016)
    checks = [i for i, chain in enumerate(chains) if chain == (0, 1)]
    # a check is 3 steps (the first pays for the change of mode): after 4 steps at first, then 8, 16, at most 32
    # while checks confirm it
    assert checks == [0, 1, 2, 10, 11, 12, 28, 29, 30]
    assert ctl.decide(batch=1).chain == (0, 1)  # nothing observed at one request: the model's plan
    for _ in range(40):
        stats.drafting.observe(16, True, 60, 0.040)  # drafting turns out faster (the content changed)
    chains = []
    for _ in range(20):
        chains.append(ctl.decide(batch=16).chain)
        drafted = len(chains[-1]) > 1
        stats.drafting.observe(16, drafted, 60 if drafted else 16, 0.040 if drafted else 0.016)
    assert chains.count((1,)) <= CHECK_STEPS  # drafting is back, plain decoding run only by a check


def test_drafting_predicted_faster_within_the_margin_runs_where_observed_faster():
    """Drafting predicted faster than the target alone, but by less than the speculation margin (the model's error
    where the gain is marginal), decodes plainly until a check has tried it, and then drafts where drafting steps
    were observed faster at this load, and not where they were observed slower. (Measured, single request, T = 0.8:
    the small model drafting at depth 2 ran 8% faster than the target alone, which the model could not tell.)"""
    costs = {0: linear(0.5e-3, 0.01e-3), 1: linear(2.0e-3, 0.1e-3)}
    ctl = make(costs, [False, False], (1,), (), explore_every=0, check_every=4, explore_budget=1.0)
    simulate(ctl, {(0, 1): 0.55}, costs, 20, steps=False)  # drafting predicted a few percent faster than plain
    alone = ctl.plan_for((1,))
    drafting = ctl.plan_for((0, 1))
    assert alone.throughput < drafting.throughput < 1.1 * alone.throughput
    stats = ctl.global_stats

    def run(steps, drafted_rate, batch=1):
        chains = []
        for _ in range(steps):
            chains.append(ctl.decide(batch=batch).chain)
            drafted = len(chains[-1]) > 1
            stats.drafting.observe(batch, drafted, 1, 1 / drafted_rate if drafted else 1 / 500)
        return chains

    chains = run(40, 560)  # drafting steps really are faster: 560 tokens/s against 500
    assert chains[0] == (1,) and chains[-20:].count((1,)) <= 2 * CHECK_STEPS  # it drafts, but for checks
    chains = run(200, 440)  # the content changed: drafting steps are slower now
    assert chains[-10:] == [(1,)] * 10
    assert run(1, 440, batch=16) == [(1,)]  # nothing observed at another load: the target alone


def test_pipelined_plan_hides_drafting_behind_the_target():
    """With drafting ahead (runtime.pipeline), a round costs (1 − α^{k+1})·T(k) + max(c(k+1), T(k+1)): the
    drafting is hidden up to the target's pass, so the plan predicts more than synchronously;
    a model-free drafter right under the target is not pipelined, so its plan is unchanged."""
    from cascade.controller import plan_chain

    def draft_cost(t):
        return 0.002

    def target_cost(t):
        return 0.010 + 0.0005 * t

    alpha = 0.8
    costs = [draft_cost, target_cost]
    sync = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8)
    piped = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8, pipelined=True)
    k = piped.depths[-1]
    hidden = (1 - alpha ** (k + 1)) * k * 0.002 + max(target_cost(k + 1), (k + 1) * 0.002)
    assert piped.throughput == pytest.approx(expected_tokens(alpha, k) / hidden)
    assert piped.throughput > sync.throughput
    lookup = plan_chain((0, 1), [0.0, alpha], costs, [True, False], max_depth=8)
    assert plan_chain((0, 1), [0.0, alpha], costs, [True, False], max_depth=8, pipelined=True) == lookup


def test_pipeline_check_drafts_ahead_only_where_observed_to_pay():
    """The pipelined mode's observed check: each mode tried, the faster one run at each load, the other checked
    every ``check_every`` steps; a step right after a change of mode is not counted."""
    from cascade.controller.checks import PipelineCheck

    check = PipelineCheck(ControllerParams(check_every=16))
    modes = []
    for _ in range(200):
        ahead = check.ahead(1)
        modes.append(ahead)
        check.observe(1, ahead, 4, 0.010 if ahead else 0.008)  # drafting ahead observed slower at batch 1
    assert modes[0] is True and False in modes[:8]  # both tried at once
    late = modes[100:]
    assert late.count(True) <= len(late) // 16 * (1 + ControllerParams().pipeline_check_steps) and True in late  # checked
    for _ in range(200):  # at another load it pays
        ahead = check.ahead(16)
        check.observe(16, ahead, 40, 0.020 if ahead else 0.030)
    assert check.favoured(16) and not check.favoured(1)


@pytest.mark.parametrize("extra_seconds", [0.001, 0.100])
def test_explorations_cost_at_most_their_budget_of_the_engines_time(extra_seconds):
    """Explorations are paid from ``explore_budget`` of the engine's time at the cost the engine's steps measured:
    cheap ones run every ``explore_every`` steps, and expensive ones (a drafter catching up on long contexts) run
    only as often as the budget allows, so together they never cost more than that fraction."""
    cost = {0: COSTS[1], 1: COSTS[2], 2: COSTS[3]}
    alpha = {(0, 1): 0.01, (0, 2): 0.01, (1, 2): 0.8}
    ctl = make(cost, [False, False, False], (0, 1, 2), (4, 4), explore_every=4, explore_budget=0.02)
    simulate(ctl, alpha, cost, 100)  # every chain tried
    stats, step, spent, total, explorations = ctl.global_stats, 0.010, 0.0, 0.0, 0
    for _ in range(4000):
        simulate(ctl, alpha, cost, 1)
        seconds = step + extra_seconds * ctl.explored  # an exploration commits as much as a step, later
        stats.observe_spending(1, 1, seconds, ctl.explored)
        spent += seconds - step
        total += seconds
        explorations += ctl.explored
    if extra_seconds < 0.005:
        # the budget does not bind: the backed-off interval does, an exploration due in a check's steps waiting for
        # its end
        assert explorations >= 4000 // (4 * 8 + CHECK_STEPS)
    else:
        assert 0 < explorations < 4000 // (4 * 8)
    assert spent <= 0.02 * total + extra_seconds


def test_the_step_that_changes_mode_is_not_counted_by_the_observed_check():
    """The first drafting step after plain ones pays for the drafters catching up on every token they did not see;
    counted, it made each check confirm that drafting does not pay, even where drafting runs at twice the rate."""
    stats = GlobalStats(2, ControllerParams(check_every=4))
    for _ in range(8):
        stats.drafting.observe(1, False, 1, 0.002)  # plain: 500 tokens/s
    stats.drafting.observe(1, True, 5, 0.050)  # the change: a drafter catches up on a whole context
    stats.drafting.observe(1, True, 5, 0.005)  # drafting as it runs: 1,000 tokens/s
    stats.drafting.observe(1, True, 5, 0.005)
    assert stats.drafting.observed(1) is True


def test_one_stretched_pass_does_not_price_a_depth_out():
    """A pass that a pause stretched (the KV cache growing inside it) counts at most three times its count's mean,
    so it cannot make that count, and every count above it, look several times dearer for dozens of passes; a real
    rise in cost is still followed."""
    def cost(t):
        return 2e-3 + 0.1e-3 * t

    fit = CostFit()
    for _ in range(30):
        for t in range(1, 10):
            fit.add(t, cost(t))
    fit.add(9, 0.200)
    assert fit(9) < 1.2 * cost(9) and fit(12) < 1.2 * cost(12)
    fit.add(5, 0.200)  # the running maximum used to lift every count above a stretched one
    assert fit(6) < 1.2 * cost(6)
    for _ in range(60):
        for t in range(1, 10):
            fit.add(t, 2 * cost(t))  # the machine really is twice as slow now
    assert fit(9) == pytest.approx(2 * cost(9), rel=0.1)


def test_one_stretched_step_does_not_turn_drafting_off():
    """A drafting step that a pause stretched thirty times (a KV cache growing by a copy of every slot) counts at
    most three times the mean step: drafting, observed faster than plain decoding, stays on; steps that really are
    slower turn it off."""
    stats = GlobalStats(2, ControllerParams())
    for _ in range(12):
        stats.drafting.observe(1, False, 1, 0.002)  # plain: 500 tokens/s
    for _ in range(12):
        stats.drafting.observe(1, True, 8, 0.007)  # drafting: 1,140 tokens/s
    stats.drafting.observe(1, True, 9, 0.230)
    assert stats.drafting.observed(1) is True
    for _ in range(40):
        stats.drafting.observe(1, True, 2, 0.007)  # drafting's acceptance collapses: 290 tokens/s
    assert stats.drafting.observed(1) is False


def test_a_check_ends_after_its_steps_however_they_are_mixed():
    """A check of drafting runs its few steps and ends even when the steps say nothing about drafting (found
    continuations verified in every step of a loaded batch): it used to wait for a step without any, holding every
    deciding request in the checked mode and charging every step to the explorations' budget meanwhile."""
    stats = GlobalStats(2, ControllerParams(check_every=4))
    for _ in range(2):
        stats.drafting.observe(16, False, 16, 0.040)
    for _ in range(4):
        stats.drafting.observe(16, True, 30, 0.040)
    assert stats.drafting.runs(16) is False and stats.checked  # drafting observed faster here: a check runs plain
    for _ in range(3):
        stats.drafting.observe(16, None, 40, 0.040)  # every step also verified found continuations
    assert not stats.checked and stats.drafting.runs(16) is True


def test_a_mode_observed_faster_is_checked_too():
    """Traced at 64 sampled requests: the first plain steps at that load ran beside the prefill of a burst of arriving
    prompts, slowly, so drafting was observed faster there; and since a check ran only where the mode was disfavoured
    or unobserved, the small model drafted for as long as the load lasted, whatever plain decoding's real rate. Now a
    check runs the other mode whichever the rates favour, re-measuring it (what was seen of it before keeps a
    twentieth of its weight), and here drafting gives way after the first check."""
    stats = GlobalStats(2, ControllerParams(check_every=16, explore_budget=1.0))
    check = stats.drafting
    for _ in range(2):
        check.observe(64, False, 64, 0.100)  # plain steps beside a prefill burst: 640 tokens/s
    modes = []
    for _ in range(60):
        modes.append(check.runs(64))
        check.observe(64, modes[-1], 100 if modes[-1] else 64, 0.032 if modes[-1] else 0.017)  # 3,125 against 3,765
    first = modes.index(False)
    assert 0 < first <= 16 and modes[first : first + CHECK_STEPS] == [False] * CHECK_STEPS  # the first check
    assert modes[first + CHECK_STEPS :].count(True) <= CHECK_STEPS  # then plain decoding, drafting only in a check


def test_drafters_reading_the_arriving_prompts_is_charged_to_drafting():
    """A model drafter reads every prompt once, in its first pass of a step: with P prompt tokens arriving per step
    a drafting round costs ĉ_d(B + P) − ĉ_d(B) more, which the target alone never pays (it prefills them either
    way). Drafting that pays with no prompts arriving gives way to plain decoding when enough arrive; a model-free
    drafter reads nothing."""
    from cascade.controller import best_plan, plan_chain

    def drafter(t):
        return 0.001 + 0.00002 * t

    def target(t):
        return 0.004 + 0.0001 * t

    costs, alpha, batch, arriving = [drafter, target], 0.7, 16, 150
    quiet = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8, batch=batch)
    busy = plan_chain((0, 1), [0.0, alpha], costs, [False, False], max_depth=8, batch=batch, catch_up=arriving)
    k = busy.depths[-1]
    round_time = k * drafter(batch) + target(batch * (k + 1)) + drafter(batch + arriving) - drafter(batch)
    assert busy.throughput == pytest.approx(batch * expected_tokens(alpha, k) / round_time)
    assert busy.throughput < quiet.throughput
    pair = {(0, 1): alpha}.__getitem__
    assert best_plan(lambda i, j: pair((i, j)), costs, [False, False], 8, batch=batch).chain == (0, 1)
    assert best_plan(lambda i, j: pair((i, j)), costs, [False, False], 8, batch=batch, catch_up=arriving).chain == (1,)
    lookup = plan_chain((0, 1), [0.0, alpha], costs, [True, False], max_depth=8, batch=batch)
    assert plan_chain((0, 1), [0.0, alpha], costs, [True, False], max_depth=8, batch=batch, catch_up=arriving) == lookup


def test_a_continuation_is_valued_against_the_round_the_request_would_run():
    """Where the model's plan drafts with the small model but the engine's steps at this load observed drafting
    slower, a request's round decodes plainly, and a found continuation is weighed against that plain round, not
    against the drafting round that does not run. (Weighed against the drafting plan, continuations that beat plain
    decoding were declined: traced at one client, greedy, the engine then decoded plainly at half the rate.)"""
    ctl = _drafting_controller(lookup_alpha=0.5)
    stats = ctl.global_stats
    assert ctl.lookup_value(batch=1, step_tokens=9).depth == 0  # the drafting round commits more, faster
    for drafting, tokens, seconds in [(True, 2, 0.008)] * 6 + [(False, 1, 0.002)] * 6:
        stats.drafting.observe(1, drafting, tokens, seconds)  # at this load drafting runs at 250 tokens/s, plain 500
    assert ctl.decide().chain == (2,)
    value = ctl.lookup_value(batch=1, step_tokens=1)
    assert value.base == 1.0  # a plain round's one token
    assert value.depth >= 2 and value.gain(value.depth) > value.threshold


def test_a_check_of_found_continuations_verifies_them_whatever_their_estimate():
    """Found continuations observed slower are declined, and their acceptance estimate, renewed by a check's few
    positions, may say they are worthless; a check that runs them must still verify what it finds, at least
    explore_depth deep, or it would observe steps without them and confirm the verdict for ever (traced: one
    check's rejected continuations put α at 0.04, and a greedy engine then ran without them for 1,100 steps)."""
    ctl = _warm_controller(linear(10e-3, 0.5e-3), linear(8e-3, 0.5e-3), check_every=4, explore_budget=1.0)
    stats = ctl.global_stats
    for _ in range(20):
        ctl.observe_round(0, 1, 4, 0, expected=0.0)  # every guess rejected
    for found in [True] * 4 + [False] * 4:
        stats.lookups.observe(1, found, 1 if found else 2, 0.010 if found else 0.008)  # found ones: slower
    checks = []
    for step in range(40):
        taken = ctl.take_lookup(1)
        value = ctl.lookup_value(batch=1, step_tokens=1)
        assert value.probe == taken  # taken only by a check
        assert value.depth >= ctl.params.explore_depth if taken else value.depth == 0
        checks += [step] * taken
        stats.lookups.observe(1, taken, 1 if taken else 2, 0.010 if taken else 0.008)
    assert checks and len(checks) < 40 // 2  # checks now and then; otherwise declined


@pytest.mark.parametrize("backlog", [0, 2000])
def test_a_check_waits_until_the_budget_covers_the_drafters_catching_up(backlog):
    """A check that drafts first makes the drafters read whatever they have not of every context in the batch
    (traced at 64 sampled requests: one such check took 0.66 s of a 5 s level). Paid for afterwards, it took those
    seconds from the requests of its moment; now it waits until the budget covers its predicted catch-up, saving up
    for it meanwhile, while a check with nothing to catch up on runs when due."""
    params = ControllerParams(check_every=4, explore_budget=0.01)
    stats = GlobalStats(2, params)
    for tokens in (1, 10, 100, 1000):
        for _ in range(4):
            stats.observe_pass(0, tokens, 1e-4 * tokens, plain=True)  # the drafter reads 10,000 tokens a second
    check = stats.drafting
    for mode in (True,) * 4 + (False,) * 4:  # drafting observed slower than plain decoding at this load
        check.observe(64, mode, 80 if mode else 64, 0.040 if mode else 0.020)
    predicted = stats.catch_up((0, 1), [False, False], [backlog, 0])
    assert predicted == pytest.approx(1e-4 * backlog)
    modes = []
    for _ in range(1500):
        modes.append(check.runs(64, cost=lambda: stats.catch_up((0, 1), [False, False], [backlog, 0])))
        catching_up = modes[-1] and not (len(modes) > 1 and modes[-2])  # a check's first step
        seconds = 0.020 + (predicted if catching_up else 0.0)
        stats.observe_spending(64, 64, seconds, check.checked)
        check.observe(64, modes[-1], 64, seconds)
    first = modes.index(True)
    if backlog == 0:
        assert first < 4
    else:  # 0.2 s of catching up, saved at 1% of 20 ms steps: a thousand steps
        assert 0.99 * predicted / (0.01 * 0.020) <= first < 1.1 * predicted / (0.01 * 0.020)
        assert modes[first : first + CHECK_STEPS] == [True] * CHECK_STEPS


@pytest.mark.parametrize("backlog", [100, 50_000])
def test_drafting_after_plain_steps_must_repay_the_drafters_catching_up(backlog):
    """Drafting observed a little faster than plain decoding at this load (here 1,100 against 1,000 tokens/s, 64
    tokens a step) turns on after plain steps only where what it saves over ``rate_window`` steps beats what the
    drafters must first read of the batch's contexts (traced at 64 greedy requests: a drafting step after plain ones
    spent 100–250 ms catching up, against 40 ms steps, and the changes of mode made Cascade 5% slower than the target
    alone). Once drafting runs, it keeps running; the found-continuation check has no such cost."""
    params = ControllerParams(check_every=0)
    stats = GlobalStats(2, params)
    for tokens in (1, 10, 100, 1000, 10_000):
        for _ in range(4):
            stats.observe_pass(0, tokens, 1e-5 * tokens, plain=True)  # the drafter reads 100,000 tokens a second
    check = stats.drafting
    for mode in (True,) * 4 + (False,) * 4:
        check.observe(64, mode, 64, 64 / 1100 if mode else 64 / 1000)
    catch_up = stats.catch_up((0, 1), [False, False], [backlog, 0])
    saved = params.rate_window * 64 * (1 / 1000 - 1 / 1100)  # ~0.19 s over 32 steps
    assert check.observed(64) is True
    assert check.runs(64, cost=lambda: catch_up) is (catch_up < saved)  # after a plain step
    check.observe(64, True, 64, 64 / 1100)
    assert check.runs(64, cost=lambda: catch_up) is True  # drafting runs: nothing left to catch up on
    stats.lookups.observe(64, True, 64, 64 / 1100)
    stats.lookups.observe(64, False, 64, 64 / 1000)
    stats.lookups.observe(64, True, 64, 64 / 1100)
    assert stats.lookups.runs(64) is True


def test_a_new_load_decodes_plainly_first_then_runs_the_plan_made_for_it():
    """When the load moves (one client, then 64 arriving together), the first steps at the new load decode plainly:
    they measure the target's plain pass there, which the model otherwise extrapolates from one request's passes
    (traced at 64 sampled requests after one client: it priced the target alone at a third of its rate, and the small
    model drafted, 15% slower). Then every request runs the plan made for this load, at once (not the one-client plan
    until the next re-optimisation), here drafting less deep than one client did, the target's pass being
    bandwidth-bound but not free."""
    target = linear(4e-3, 0.02e-3)
    costs = {0: linear(0.5e-3, 0.01e-3), 1: target}
    alpha = {(0, 1): 0.8}
    ctl = make(costs, [False, False], (0, 1), (4,), explore_every=0, check_every=1000)  # no check in sight
    plans = simulate(ctl, alpha, costs, 60)  # one client
    assert plans[-1].chain == (0, 1)
    one_client_depths = plans[-1].depths
    stats = ctl.global_stats

    def step(batch: int) -> Plan:
        """One engine step of ``batch`` requests, one plan for all; observed as the engine observes it."""
        plan = ctl.decide(batch=batch)
        if len(plan.chain) == 1:
            seconds = target(batch)
            ctl.global_stats.observe_pass(1, batch, seconds, plain=True)
            stats.drafting.observe(batch, False, batch, seconds)
        else:
            k = plan.depths[0]
            seconds = k * costs[0](batch) + target(batch * (k + 1))
            ctl.global_stats.observe_pass(1, batch * (k + 1), target(batch * (k + 1)))
            stats.drafting.observe(batch, True, round(batch * expected_tokens(0.8, k)), seconds)
        return plan

    assert [step(64).chain for _ in range(2)] == [(1,), (1,)]  # plain first: the change, then one counted
    then = [step(64) for _ in range(4)]
    best = ctl.plan_for((0, 1), 64)
    assert all(p.chain == (0, 1) and p.depths == best.depths for p in then)
    assert best.depths[0] < one_client_depths[0]


def test_no_exploration_runs_in_a_checks_steps():
    """A step where a request explores says nothing about drafting, so an exploration in a check's few steps left
    the check without an observation (traced at 64 sampled requests: a check that ran plain decoding observed nothing,
    and the small model drafted, 15% slower, until the next check). An exploration due then waits for its end."""
    cost = {0: COSTS[1], 1: COSTS[3]}
    ctl = make(cost, [False, False], (0, 1), (4,), explore_every=1, check_every=4, explore_budget=1.0)
    checks, explored = [], []
    for _ in range(300):
        simulate(ctl, {(0, 1): 0.7}, cost, 1, checks=checks)
        explored.append(ctl.explored)
    assert any(checks) and any(explored)  # both ran
    assert not any(c and e for c, e in zip(checks, explored))


def test_steps_that_say_nothing_do_not_break_a_run_of_the_mode():
    """At one client most steps verify a found continuation and say nothing about drafting, and a model step was
    counted only right after another model step: the check judged drafting by one to three steps, and fresh engines
    on the same prompts read 144-315 tokens/s by where those few steps fell (254-282 since). Steps that say nothing
    are passed over now; a change of mode is still not counted."""
    stats = GlobalStats(2, ControllerParams(check_every=0))
    check = stats.drafting
    for _ in range(2):
        check.observe(1, False, 1, 0.002)  # plain: 500 tokens/s
    for _ in range(6):
        check.observe(1, None, 4, 0.006)  # a found continuation verified
        check.observe(1, True, 3, 0.008)  # the small model drafting: 375 tokens/s
    assert check.observed(1) is False
    check.observe(1, None, 4, 0.006)
    check.observe(1, False, 1, 0.050)  # a change of mode (a slow one) after the continuation: not counted
    assert check.observed(1) is False


def observed_both_ways(check, batch, plain, drafting, steps=8):
    """``steps`` plain steps, then ``steps`` drafting ones, at one load: ``(tokens, seconds)`` of each kind of step."""
    for _ in range(steps):
        check.observe(batch, False, *plain)
    for _ in range(steps):
        check.observe(batch, True, *drafting)


def test_a_new_load_is_judged_by_the_nearest_load_observed_with_and_without_the_mode():
    """As a loaded batch drains (64 requests finishing one after another), it passes through loads where drafting was
    never observed; each used to count as paying until observed, and a drafting step there made the small model
    catch up on every context first (traced: one step of 280 ms at 42 requests, 4% of a run's decode time). Now the
    nearest load observed both ways decides; a load far from any is still tried."""
    stats = GlobalStats(2, ControllerParams(check_every=0))
    check = stats.drafting
    observed_both_ways(check, 64, plain=(64, 0.017), drafting=(80, 0.032))  # 3,765 and 2,500 tokens/s
    check.observe(48, False, 48, 0.014)  # the batch drains to 48 requests, decoding plainly
    assert load_bucket(48) != load_bucket(64) and (load_bucket(48), True) not in check.rates
    assert check.observed(48) is False
    assert check.runs(48, cost=lambda: 0.280) is False  # no switch to drafting, nor its catching up
    check.observe(8, False, 8, 0.004)  # far from any load observed with drafting: plain first, then drafting is tried
    assert check.observed(8) is None and check.runs(8) is True


def test_each_untried_chain_is_tried_by_one_request_of_a_step():
    """Early in the engine's life every chain is tried once, by one request of a step, one chain a step: in a fresh
    server under 64 sampled clients, every request of a step once tried the same untried chain (41 requests drafted
    with the medium model in one step, which first read all their contexts). A chain handed out but still unobserved
    (its request left) is handed out again."""
    params = ControllerParams(warmup_rounds=0)
    ctl = AdaptiveController(GlobalStats(len(COSTS), params), [True, False, False, False], Plan((0, 1, 2, 3), (4, 4, 4), 0.0),
                             params)
    tried = []
    for _ in range(3 * len(candidate_chains(4))):
        plan = ctl.decide(16)  # one request explores, the other fifteen run ctl.running
        if not ctl.explored:
            break
        tried.append(plan.chain)
        if len(tried) % 2:
            continue  # its request left before its round was verified: nothing was observed of it
        for p in range(1, len(plan.chain)):
            ctl.observe_round(plan.chain[p - 1], plan.chain[p], 4, 2)
        if len(plan.chain) == 1:
            ctl.global_stats.observe_pass(plan.chain[0], 16, 0.01, plain=True)
    assert tried[0::2] == tried[1::2]  # each handed out twice: first unobserved, then observed
    assert len(set(tried)) == len(tried) // 2 and ctl.global_stats.all_tried  # one chain a step, till all are observed


def test_a_chain_no_step_can_observe_is_not_tried_every_step():
    """The target alone, explored by one request of a step whose other rounds verify drafts, times no plain pass:
    traced at 16 emulated clients, it was handed out again in 11 steps, each an exploration the observed checks do
    not count. An untried chain is handed out a few times, then left to the periodic explorations."""
    params = ControllerParams(warmup_rounds=0)
    ctl = AdaptiveController(GlobalStats(len(COSTS), params), [True, False, False, False], Plan((0, 1, 2, 3), (4, 4, 4), 0.0),
                             params)
    alone = []
    for _ in range(40):
        plan = ctl.decide(16)
        alone.append(ctl.explored and len(plan.chain) == 1)
        for p in range(1, len(plan.chain)):
            ctl.observe_round(plan.chain[p - 1], plan.chain[p], 4, 2)
        ctl.global_stats.observe_pass(3, 16 * 5, 0.02)  # every step's target pass verifies drafts: none is plain
    assert 1 <= sum(alone[:20]) <= 3
    assert ctl.global_stats.all_tried


def test_a_mode_slower_at_a_lighter_load_is_taken_as_slower_at_a_heavier_one():
    """Either mode adds positions to every request's pass, which costs more per position the more requests share it.
    Traced at 64 sampled requests after a 16-client level where drafting ran slower: two drafting steps as the batch
    first reached 59 requests made the small model catch up on every context (4% of the level's decode time). A load
    far from any observed both ways now takes a lighter load's 'slower' and a heavier load's 'faster'."""
    stats = GlobalStats(2, ControllerParams(check_every=0))
    check = stats.drafting
    observed_both_ways(check, 16, plain=(16, 0.008), drafting=(24, 0.013))  # 2,000 and 1,846 tokens/s
    check.observe(59, False, 59, 0.025)  # the batch grows to 59 requests, decoding plainly
    assert check.observed(59) is False
    assert check.runs(59, cost=lambda: 0.165) is False  # no drafting, nor its catching up
    check.observe(4, False, 4, 0.002)  # plain first at a new load, then drafting is tried: a lighter load is not
    assert check.observed(4) is None and check.runs(4) is True  # bounded by a heavier one

    faster = GlobalStats(2, ControllerParams(check_every=0)).drafting
    observed_both_ways(faster, 59, plain=(59, 0.025), drafting=(100, 0.030))
    faster.observe(4, False, 4, 0.004)
    assert faster.observed(4) is True  # faster at a heavier load: faster at a lighter one
    assert faster.observed(128) is None


def test_a_mode_observed_faster_only_within_the_margin_does_not_run():
    """Two identical engines taking turns read 4-5% apart, and a step with the mode is longer, which every arriving
    prompt waits for: a mode observed faster by less than ``observed_margin`` is taken as not paying."""
    stats = GlobalStats(2, ControllerParams(check_every=0))
    check = stats.drafting
    observed_both_ways(check, 64, plain=(64, 0.030), drafting=(112, 0.052))  # 2,133 and 2,154 tokens/s: 1% faster
    assert check.observed(64) is False and check.runs(64) is False
    for _ in range(64):
        check.observe(64, True, 112, 0.045)  # drafting: 2,489 tokens/s, 17% faster
    assert check.observed(64) is True and check.runs(64) is True


def test_a_step_enters_the_checks_only_when_it_says_something_about_a_mode():
    """GlobalStats.observe_step: a step where a request explored, or where only some requests' models drafted, is
    no observation of drafting against plain decoding; steps that all drafted, or all decoded plainly, are."""
    stats = GlobalStats(2, ControllerParams())
    for _ in range(4):  # said nothing: explorations and mixed steps (counted, they would make plain decoding look fast)
        stats.observe_step(8, 80, 0.010, explored=True, drafted=[False] * 8)
        stats.observe_step(8, 80, 0.010, explored=False, drafted=[False, True] * 4)
    assert stats.drafting.observed(8) is None
    for _ in range(3):
        stats.observe_step(8, 8, 0.010, explored=False, drafted=[False] * 8)  # plain: 800 tokens/s
    for _ in range(3):
        stats.observe_step(8, 24, 0.012, explored=False, drafted=[True] * 8)  # drafting: 2,000 tokens/s
    assert stats.drafting.observed(8) is True
    stats.observe_step(8, 8, 0.010, explored=False, drafted=[False] * 8, looked_up=True)
    stats.observe_step(8, 8, 0.010, explored=False, drafted=[False] * 8, looked_up=True)
    stats.observe_step(8, 8, 0.010, explored=True, drafted=[False] * 8, looked_up=False)
    assert stats.lookups.observed(8) is None  # found continuations observed, steps without them not yet


def test_a_requests_lookup_value_follows_the_estimates_under_load():
    """A request's lookup value is re-optimised every ``replan_every`` of its steps at any load. Kept for
    ``replan_every`` steps per 8 requests, one valued while the n-gram drafter's acceptance was read low declined every
    found continuation for 32 steps at 64 requests after the acceptance had been measured high (emulated MI300X,
    where n-gram rounds ran 13% faster than the small model's)."""
    ctl = _warm_controller(linear(0.040, 0.4e-3), linear(0.038, 0.4e-3))
    own = ctl.admit()
    for _ in range(20):
        ctl.observe_round(0, 1, 4, 0, expected=0.1 * 4)  # continuations rejected at once
    assert ctl.lookup_value(batch=64, step_tokens=64, own=own).depth == 0
    for _ in range(200):
        ctl.observe_round(0, 1, 4, 4, expected=0.9 * 4)  # then accepted whole
    later = [ctl.lookup_value(batch=64, step_tokens=64, own=own).depth for _ in range(ctl.params.replan_every)]
    assert later[-1] >= 2
