"""The engine's one controller, through its two doors: StepController.plan (plans out) and StepController.observe
(what a step did, in). Requests here are the few fields the controller reads of one."""

from __future__ import annotations

from dataclasses import dataclass

from cascade.controller import ControllerParams, Plan, StepController, StepRecord

NGRAM, SMALL, TARGET = 0, 1, 2
MODEL_FREE = [True, False, False]
INITIAL = Plan((NGRAM, SMALL, TARGET), (3, 2), 0.0)


@dataclass(eq=False)
class Asking:
    """A request as the controller sees it."""

    regime: str
    acceptance: object
    width: int = 1


def requests(step: StepController, count: int, regime: str = "greedy") -> list[Asking]:
    return [Asking(regime, step.admit(regime)) for _ in range(count)]


def never_looked_up(request, depth):
    raise AssertionError("no lookup without the shortcut")


def no_backlog(regime):
    return [0, 0, 0]


def test_observations_enter_only_when_the_step_is_observed():
    """Passes, verified drafts and prefilled tokens recorded during a step reach the statistics at observe, each
    into the regimes of the requests that took part, and nowhere else."""
    step = StepController(ControllerParams(), MODEL_FREE, INITIAL)
    asking = requests(step, 2)
    plan = step.plan(asking, {}, never_looked_up, no_backlog, pipelined=False)
    record = StepRecord()
    record.on_pass(SMALL, 4, 0.002, False, frozenset({"greedy"}))
    record.on_pass(TARGET, 6, 0.010, False, frozenset({"greedy"}))
    record.on_round("greedy", asking[0].acceptance, SMALL, TARGET, 2, 2, None)
    record.prefill_tokens = 32
    record.batch, record.committed, record.seconds = 2, 6, 0.012
    greedy, sampling = step.regimes["greedy"], step.regimes["sampling"]
    assert not greedy.costs[TARGET].verify.observed and greedy.pair_alpha(SMALL, TARGET) is None
    step.observe(record)
    assert greedy.costs[TARGET].verify.observed and greedy.costs[SMALL].verify.observed
    assert greedy.pair_alpha(SMALL, TARGET) == 1.0  # two drafted, two accepted
    assert greedy.prompt_rate > 0 and sampling.prompt_rate == greedy.prompt_rate  # every regime's drafters read it
    assert not sampling.costs[TARGET].verify.observed and sampling.pair_alpha(SMALL, TARGET) is None
    assert set(plan.rounds) == set(asking)


def test_a_regimes_requests_run_one_shared_plan():
    """After the warm-up, every request of a regime in a step runs the same plan (explorations aside): a step pays
    once for a drafter's pass and for verifying at all, whichever of its requests draft."""
    step = StepController(ControllerParams(explore_every=0, check_every=0), MODEL_FREE, INITIAL)
    asking = requests(step, 8)
    for _ in range(6):
        plan = step.plan(asking, {}, never_looked_up, no_backlog, pipelined=False)
        step.observe(StepRecord(batch=len(asking), committed=len(asking), seconds=0.01))
    assert len({p for p, _ in plan.rounds.values()}) == 1
    assert not plan.explored and plan.ahead is None


def test_the_shortcut_takes_found_continuations_first_then_drafts_made_ahead():
    """With the shortcut, a request whose context the n-gram drafter continues drafts straight for the target with
    what was found, even where the pipelined mode drafted ahead for it; a request with a draft made ahead and no
    continuation verifies that draft under the plan that made it; the others get the models' plans, which never
    include the n-gram drafter."""
    step = StepController(ControllerParams(), MODEL_FREE, INITIAL, shortcut=True)
    found, ahead, plain = requests(step, 3)
    drafted_ahead = Plan((SMALL, TARGET), (2,), 0.0)
    looked = []

    def lookup(request, depth):
        looked.append(request)
        return [5, 6, 7][:depth] if request is not plain and request is not ahead else []

    plan = step.plan([found, ahead, plain], {found: drafted_ahead, ahead: drafted_ahead}, lookup, no_backlog, False)
    assert plan.rounds[found] == (Plan((NGRAM, TARGET), (3,), 0.0), [5, 6, 7])
    assert plan.rounds[ahead] == (drafted_ahead, None) and plan.kept == {ahead}
    assert plan.rounds[plain][1] is None and NGRAM not in plan.rounds[plain][0].chain
    assert set(looked) == {found, ahead, plain}


def test_drafting_ahead_only_where_a_model_drafts_for_the_target():
    """The pipelined mode can draft ahead only for rounds whose draft for the target comes from a model; a step of
    plain rounds says no drafting ahead is possible (None), not that it was declined."""
    step = StepController(ControllerParams(pipelined=True), MODEL_FREE, Plan((TARGET,), (), 0.0))
    asking = requests(step, 2)
    assert step.plan(asking, {}, never_looked_up, no_backlog, pipelined=True).ahead is None
    drafting = StepController(ControllerParams(pipelined=True), MODEL_FREE, Plan((SMALL, TARGET), (2,), 0.0))
    assert drafting.plan(requests(drafting, 2), {}, never_looked_up, no_backlog, pipelined=True).ahead is not None


def test_the_backlog_is_counted_at_most_once_and_only_for_its_step():
    """What the drafters have not read is the step's: each step's count is asked for at most once, by that step."""
    step = StepController(ControllerParams(check_every=2, explore_budget=1.0), MODEL_FREE, INITIAL)
    asking = requests(step, 4)
    calls = []
    for i in range(40):
        step.plan(asking, {}, never_looked_up, lambda regime, i=i: calls.append(i) or [0, 40, 0], pipelined=False)
        step.observe(StepRecord(batch=len(asking), committed=len(asking), seconds=0.01))
    assert calls == sorted(set(calls))


def test_a_step_is_decided_once_per_regime_and_explored_by_one_request():
    """The regime's plan is decided once per step, however many of its requests the step holds, and an exploration,
    when one runs, is one request's round: the others run the regime's plan (every one of them exploring would make
    each drafter catch up on every context at once)."""
    step = StepController(ControllerParams(warmup_rounds=0, explore_every=1, explore_budget=1.0, check_every=0),
                          MODEL_FREE, INITIAL)
    asking = requests(step, 16) + requests(step, 3, regime="sampling")
    explorations = 0
    for i in range(1, 21):
        plan = step.plan(asking, {}, never_looked_up, no_backlog, pipelined=False)
        assert step.regimes["greedy"].steps == step.regimes["sampling"].steps == i
        for regime in ("greedy", "sampling"):
            exploring = [r for r in plan.explored if r.regime == regime]
            assert len(exploring) <= 1
            others = {plan.rounds[r][0] for r in asking if r.regime == regime and r not in plan.explored}
            assert len(others) == 1
        explorations += len(plan.explored)
        step.observe(StepRecord(batch=len(asking), committed=len(asking), seconds=0.01))
    assert explorations > 0


def test_draft_trees_run_only_while_their_steps_are_observed_faster():
    """With a drafter of trees drafting for the target, a step's drafts are chains at a load where trees were not yet
    observed, trees in the checks that measure them, then as steps with trees and without were observed (faster or
    slower), with checks of the other way."""
    small_target = Plan((SMALL, TARGET), (4,), 0.0)
    params = ControllerParams(warmup_rounds=1000, check_every=8, explore_every=0)  # the initial plan throughout

    def run(trees_rate: float, chains_rate: float) -> list[bool]:
        step = StepController(params, MODEL_FREE, small_target, trees={(1, 2): 2})
        asking = requests(step, 4)
        chosen = []
        for _ in range(60):
            plan = step.plan(asking, {}, never_looked_up, no_backlog, pipelined=False)
            treed = "greedy" in plan.trees
            chosen.append(treed)
            record = StepRecord()
            record.batch, record.committed = 4, 12
            record.seconds = 12 / (trees_rate if treed else chains_rate)
            step.observe(record)
        return chosen

    slower = run(trees_rate=900.0, chains_rate=1000.0)
    assert not slower[0] and any(slower[:20]) and sum(slower[20:]) <= 10  # checked, then chains: trees only in checks
    faster = run(trees_rate=1100.0, chains_rate=1000.0)
    assert not faster[0] and sum(faster[20:]) >= 30 and not all(faster[20:])  # mostly trees, chains in checks
    without = StepController(params, MODEL_FREE, small_target)  # no stage proposes trees
    plan = without.plan(requests(without, 2), {}, never_looked_up, no_backlog, pipelined=False)
    assert plan.trees == {}


def test_draft_trees_run_first_where_their_nodes_are_nearly_free_to_verify():
    """Before steps with trees and without are observed at a load, the verifying stage's cost curve decides: trees
    where their nodes add little to its pass (a memory-bound pass on a GPU, here a roofline-like prior flat up to
    64 positions), chains where each position costs its share (a compute-bound one) or where nothing is known."""
    small_target = Plan((SMALL, TARGET), (4,), 0.0)
    params = ControllerParams(warmup_rounds=1000, check_every=0)  # the initial plan, no checks: the first choice

    def first_choice(target_cost, batch: int) -> bool:
        priors = [None, None, target_cost]
        step = StepController(params, MODEL_FREE, small_target, trees={(1, 2): 2}, priors=priors)
        plan = step.plan(requests(step, batch), {}, never_looked_up, no_backlog, pipelined=False)
        return "greedy" in plan.trees

    def memory_bound(tokens: int) -> float:  # flat until 64 positions, then compute-bound
        return 0.04 * max(1.0, tokens / 64)

    assert first_choice(memory_bound, batch=1)  # 5 positions + 8 nodes: the same pass
    assert not first_choice(memory_bound, batch=16)  # 80 positions + 128 nodes: 2.6 times the pass
    assert not first_choice(lambda tokens: 0.005 + 0.001 * tokens, batch=1)  # +8 positions: +80%
    assert not first_choice(None, batch=1)  # no curve yet: chains


def test_the_model_keeps_draft_trees_only_on_the_stage_pairs_where_they_pay():
    """Small -> medium -> target, each drafter proposing trees. Unjudged, a pair drafts trees first where its nodes
    are nearly free to verify (the target's flat pass, as on a GPU), not where each position costs its share (a
    compute-bound medium). Once each pair's rejected tree drafts are on record, the model judges it: it keeps the
    target's trees, whose branches took over half of them, and drops the medium's, whose branches never did (their
    nodes cost something and gain nothing), and that pair drafts chains."""
    small, medium, target = 0, 1, 2
    params = ControllerParams(warmup_rounds=0, explore_every=0, check_every=0, replan_every=1, unobserved_alpha=0.1)
    edges = {(small, medium): 2, (medium, target): 2}
    rescues = {(small, medium): lambda step: 0, (medium, target): lambda step: step % 2}

    def flat_until(limit: float, seconds: float):
        return lambda tokens: seconds * max(1.0, tokens / limit)

    def run(medium_cost) -> list[frozenset]:
        priors = [flat_until(64, 0.001), medium_cost, flat_until(64, 0.04)]
        step = StepController(params, [False, False, False], Plan((small, medium, target), (3, 3), 0.0), trees=edges,
                              priors=priors)
        asking = requests(step, 1)
        seen = StepRecord()  # chains seen before: both drafters often right
        for pair in edges:
            for _ in range(8):
                seen.on_round("greedy", asking[0].acceptance, *pair, 3, 3, None)
        step.observe(seen)
        chosen = []
        for i in range(40):
            plan = step.plan(asking, {}, never_looked_up, lambda regime: [0, 0, 0], pipelined=False)
            chosen.append(plan.trees.get("greedy", frozenset()))
            record = StepRecord()
            for pair in chosen[-1]:  # a rejected tree draft at each pair drafting trees
                record.on_round("greedy", asking[0].acceptance, *pair, 3, 2, None, rescues[pair](i))
            record.batch, record.committed, record.seconds = 1, 3, 0.05
            step.observe(record)
        return chosen

    steep = run(lambda tokens: 0.002 + 0.002 * tokens)  # compute-bound: 2 nodes per token cost 2/3 more
    assert steep[0] == {(medium, target)} and steep[-1] == {(medium, target)}
    flat = run(flat_until(64, 0.004))  # memory-bound: both are tried, the medium's dropped once judged
    assert flat[0] == frozenset(edges) and all(trees == {(medium, target)} for trees in flat[8:])
