"""The cascade's rounds, each request's written as a generator, and the driver that batches a step's rounds.

``propose(i, ctx, k)`` returns k tokens of stage i with, when sampling, the distribution each was drawn from:

- stage 0 samples them autoregressively (a model) or looks them up (the n-gram drafter, one-hot);
- stage i >= 1 runs rounds — draft from stage i-1, one forward pass of stage i, verify — until k tokens are out.
  The tokens of a verified round are distributed exactly as stage i, and the distribution each was drawn from
  is stage i's own ``p`` row; that row is the ``q`` the stage above verifies against. By induction the tokens
  the top commits follow the target: token for token its greedy decode, or its sampling distribution.

Batching (DESIGN.md, "The batched step"). Each request's round is that recursion written as a generator: where it
needs a stage's forward pass it *yields* the pass (:class:`~cascade.engine.passes.Verify`,
:class:`~cascade.engine.passes.ModelDraft`) and receives its result. :meth:`Rounds.drive` runs every round of a step
until each is blocked on a pass, runs the blocked passes of the lowest stage as one batched forward (and one batched
verification), sends the results back, and repeats until every round is done. Requests with different chains and
depths share the forward passes of the stages they use. Nothing about a request's output depends on the batch: its
drafts, verification and random draws (from its own generator) are the same whichever requests share the passes.

Pipelined (``runtime.pipeline``; DESIGN.md, "The pipelined form"). While the target verifies a step's drafts, a
second thread runs the stages below it: for every request whose target drafter is a model, they draft ``k + 1``
tokens ahead on the context the target is verifying (context plus draft), the first of them a guess at the target's
bonus token; then, while the target's pass lasts, a draft for each outcome where the target rejects the draft at
position j, after ``draft[:j] + [guess]``, the guess being the drafting stage's likeliest token other than
``draft[j]`` there (:meth:`Rounds._outcomes`). When the target's verdict is one of those outcomes and the token it
commits last equals that outcome's guess, the request's next round starts from that outcome's draft and rows,
without waiting for a drafter; the others are dropped, and the drafters' caches roll back to the verified tokens by
common prefix on their next pass. Exactness: greedy, a draft only changes what is checked, never what is committed.
Sampling, the next verification must see drafts drawn from the distribution it is given, conditioned on exactly the
verified prefix, with fresh randomness: each outcome's tokens come from the drafting stage's own rounds, so jointly
they follow that stage's autoregressive distribution given the outcome's context, each with the row it was drawn
from; they are drawn with a generator of their own (seeded from the request's stream), independent of the target's
acceptance and bonus draws; the guesses are fixed before the target's pass (the stage's own rows, or for the bonus
its own draw with that generator); and which outcome's draft is kept depends only on the guesses and the target's
draws (how many tokens it accepted, and whether the token it committed last is that outcome's guess). Given the
outcome and its guess, the kept draft is therefore a fresh draw from the drafter conditioned on exactly the verified
prefix, and its rows are that distribution — the ``q`` the verification is given. Which outcomes are drafted
depends on timing alone (a stopping time), not on what the target draws. A request with shared noise (``coupled``)
draws position t with the noise of (seed, t) whenever it is drafted, so ahead or not its text is the same. Requests
still share every forward pass: the target's pass covers the step's batch, and the drafting ahead of the whole batch
is one batched drive of the lower stages on the second thread.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from cascade.controller import Plan
from cascade.engine.passes import Interrupted, ModelDraft, Round, StagePasses, Verify
from cascade.engine.request import Ahead, Request
from cascade.verify import Draft, Verdict
from cascade.verify.tree import Branch

AHEAD_THREADS = 1  # torch threads of the pipelined mode's drafting thread

# ``plan.chain`` lists the stages taking part (bottom first); ``pos`` is a position in it, and the stage at
# ``pos - 1`` drafts for the stage at ``pos`` with depth ``plan.depths[pos - 1]``.


class Rounds:
    """Builds each request's round for a step and drives a step's rounds through ``passes``."""

    def __init__(self, passes: StagePasses, siblings: Sequence[int] = ()):
        self.passes = passes
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._target_seconds = 0.0  # the target's pass in the pipelined mode's last steps (a decayed mean)
        self._own_device: dict[int, bool] = {}  # stage -> on_own_device
        # (drafter, verifier) stage pairs whose rounds may draft trees -> the drafter's siblings (branch nodes per
        # draft token): a drafter that can propose trees (StagePasses.proposes_trees) to a stage that can score them
        self.tree_edges = {(i, j): n for i, n in enumerate(siblings) if n and passes.proposes_trees(i)
                           for j in range(i + 1, len(passes.stages)) if passes.scores_trees(j)}
        # per regime, the stage pairs whose drafts are trees in the step being driven (the adaptive controller's
        # choice, StepPlan.trees; None without one: every pair)
        self.trees: Mapping[str, frozenset[tuple[int, int]]] | None = None

    def top(self, plan: Plan, request: Request, context: list[int], want: int, found: Draft | None) -> Round:
        """The target's round for ``request`` under ``plan``: at most ``want`` tokens, ``found`` the draft it
        already has (or None)."""
        verdict = yield from self._round(plan, len(plan.chain) - 1, request, context, want, found)
        return verdict.tokens

    def on_own_device(self, index: int) -> bool:
        """Whether stage ``index`` computes on an accelerator of its own, so that work it does beside the target's
        pass does not slow that pass: an emulated device, a Ray actor's GPU, or a GPU the target is not on (the CPU
        cores are shared by every stage of this process, and by actors on this machine). Asked once per stage."""
        if index not in self._own_device:
            stage = self.passes.stages[index]
            report = getattr(stage, "emulation_report", None)
            device = str(getattr(stage, "device", "cpu"))
            remote = hasattr(stage, "host")  # a stage on a Ray actor (cascade.distributed.remote)
            self._own_device[index] = (report is not None and report() is not None) or (
                device.split(":")[0] not in ("cpu", "meta")
                and (remote or device != str(getattr(self.passes.stages[self.passes.target], "device", ""))))
        return self._own_device[index]

    def drive(
        self, rounds: dict[Request, Round], ahead: dict[Request, Plan] | None = None, *, interrupt: bool = True,
        outcomes: bool | None = None, stop: threading.Event | None = None,
    ) -> dict[Request, object]:
        """Run every round to completion: the passes they are blocked on, lowest stage first, one batched forward
        per stage and kind at a time (so a stage's batch gathers every request that needs it at that point).
        ``ahead``: the pipelined mode's plans; the target's passes then run beside the next rounds' drafting, which
        (``interrupt``) stops when the target's pass is done, keeping the rounds it finished; or always drafts its
        full depth, so a seeded request samples the same whatever the timing. ``outcomes``: it drafts for every
        outcome of the target's verification (True), for all of the draft accepted only (False), or for every
        outcome where the drafting stage has an accelerator of its own (None, :meth:`on_own_device`).
        ``stop``: once set, the rounds still running are interrupted before their next pass (those that end with
        what they have return it; the others are dropped)."""
        pending: dict[Request, Verify | ModelDraft] = {}
        done: dict[Request, list[int]] = {}

        def advance(request: Request, value: object) -> None:
            try:
                pending[request] = rounds[request].send(value)
            except StopIteration as finished:
                done[request] = finished.value

        for request in rounds:
            advance(request, None)
        while pending:
            if stop is not None and stop.is_set():
                for request in list(pending):
                    del pending[request]
                    try:
                        rounds[request].throw(Interrupted())
                    except StopIteration as ended:
                        done[request] = ended.value
                    except Interrupted:
                        pass
                break
            stage, kind = min((op.stage, isinstance(op, Verify)) for op in pending.values())
            group = [op for op in pending.values() if op.stage == stage and isinstance(op, Verify) == kind]
            for op in group:
                del pending[op.request]
            if kind and ahead is not None and stage == self.passes.target:
                results = self._verify_drafting_ahead(stage, group, ahead, interrupt, outcomes)
            else:
                results = self.passes.verify(stage, group) if kind else self.passes.drafts(stage, group)
            for op, result in zip(group, results):
                advance(op.request, result)
        return done

    def _round(
        self, plan: Plan, pos: int, request: Request, context: list[int], want: int, found: Draft | None = None,
        alternatives: int = 0,
    ) -> Generator[Verify | ModelDraft, object, Verdict]:
        """One round at the stage at ``pos``: draft from below, one forward pass, verify.

        ``found``: a draft this round already has (the n-gram shortcut's, or one drafted ahead), not drafted again.
        Returns the verdict: the round's tokens (accepted drafts, then the recovered or bonus token), when sampling
        the ``p`` row of this stage each was drawn from ([len(tokens), vocab]), and when asked (``alternatives``)
        this stage's next likeliest tokens beside each.
        """
        index = plan.chain[pos]
        # A round yields at most depth + 1 tokens, so drafting more than want - 1 would be wasted.
        depth = min(plan.depths[pos - 1], want - 1) if pos > 0 else 0
        if depth <= 0:
            draft = Draft.empty()
        elif found is not None:
            draft = found.prefix(depth)
        else:
            draft = yield from self._propose(plan, pos - 1, request, context, depth, siblings=self._siblings(plan, pos, request))
        verdict: Verdict = yield Verify(index, request, context + draft.tokens, draft, alternatives)
        if pos == len(plan.chain) - 1:
            request.width = len(draft.tokens) + 1
        if pos > 0:
            drafter = plan.chain[pos - 1]
            if draft.tokens:  # an empty draft (depth 0, no n-gram match) proposed nothing: it is not a draft, for
                # the request's stats and the metrics alike, so their mean accepted per draft agree
                branch_tokens = sum(len(b.tokens) for b in draft.branches)
                request.stats.stages[drafter].record_draft(len(draft.tokens), verdict.accepted, branch_tokens,
                                                           verdict.branched, verdict.rank)
                observer = self.passes.observer
                if observer is not None:
                    observer.on_draft(self.passes.stages[drafter].name, self.passes.stages[index].name,
                                      len(draft.tokens), verdict.accepted,
                                      branch_tokens, verdict.branched, verdict.rank)
            record = self.passes.step_record
            if request.acceptance is not None and record is not None:
                record.on_round(request.regime, request.acceptance, drafter, index, len(draft.tokens), verdict.accepted,
                                verdict.expected, verdict.branched if draft.branches else None)
        request.stats.stages[index].rounds += 1
        return verdict

    def _siblings(self, plan: Plan, pos: int, request: Request) -> int:
        """The draft for the round at ``pos`` is a tree with this many siblings (a model's beside each token, a
        model-free drafter's other continuations): its drafter's configured ones where the stage at ``pos`` scores
        trees (the target, or a middle stage whose path through the tree goes up as its draft), in a step whose
        trees are on for the pair and the request's regime, for a request that takes trees."""
        edge = plan.chain[pos - 1], plan.chain[pos]
        if not request.takes_trees or (self.trees is not None and edge not in self.trees.get(request.regime, ())):
            return 0
        return self.tree_edges.get(edge, 0)

    def _propose(
        self, plan: Plan, pos: int, request: Request, context: list[int], k: int, interruptible: bool = False,
        siblings: int = 0,
    ) -> Generator[Verify | ModelDraft, object, Draft]:
        """k tokens (fewer only after EOS, or from the n-gram drafter) of the stage at ``pos``, with p rows.
        ``interruptible``: :class:`Interrupted` thrown in between its rounds ends it with the tokens of the rounds
        done (the pipelined mode's drafting ahead, stopped when the target's pass is done). ``siblings``: the draft is
        a tree of up to that many branch nodes per draft token — the bottom model's grown best-first
        (:func:`cascade.stages.draft.draft_tree`); a stage above it, whose tokens are the rounds it verified, puts its
        ``siblings`` next likeliest tokens at each token's row beside it (one-token branches: its verifying passes
        computed those rows, so they cost nothing more to find)."""
        index = plan.chain[pos]
        if pos == 0 and not self.passes.is_model[index]:
            return self.passes.lookup(index, request, context, k, siblings)
        if pos == 0:  # the bottom model's whole draft in one call of the stage (a remote stage: one round trip)
            return (yield ModelDraft(index, request, context, k, siblings))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        beside: list[tuple[int, ...]] = []  # with siblings: the stage's alternatives to each token
        while len(tokens) < k:
            try:
                verdict = yield from self._round(plan, pos, request, context + tokens, k - len(tokens),
                                                 alternatives=siblings)
            except Interrupted:
                if not interruptible:
                    raise
                break
            tokens.extend(verdict.tokens)
            beside.extend(verdict.alternatives or [()] * len(verdict.tokens))
            if verdict.rows is not None:
                rows.append(verdict.rows)
            tokens, ended = self.passes.cut_at_eos(tokens)
            if ended:
                break
        tokens = tokens[:k]
        probs = torch.cat(rows)[: len(tokens)] if rows else None
        branches = tuple(Branch(j, (t,)) for j, alternatives in enumerate(beside[: len(tokens)]) for t in alternatives)
        return Draft(tokens, probs, branches)

    # ---- the pipelined mode ---------------------------------------------------------------------------------

    def _verify_drafting_ahead(
        self, index: int, ops: Sequence[Verify], plans: dict[Request, Plan], interrupt: bool, outcomes: bool | None
    ) -> list[Verdict]:
        """The target's batched pass over ``ops`` and, beside it on a second thread, the next round's drafts of every
        request whose plan has a model drafting for the target, one per outcome of this round's verification
        (:meth:`_outcomes`; the module docstring says why the output stays exact), with a generator of their own.
        The round that follows starts from the draft made for the outcome the target's verdict turned out to be."""
        rounds: dict[Request, Generator] = {}
        origin: dict[Request, int] = {}  # the op each round drafts after
        for b, op in enumerate(ops):
            request, plan = op.request, plans.get(op.request)
            if plan is None or len(plan.chain) < 2 or not self.passes.is_model[plan.chain[-2]] or not op.draft.tokens:
                continue
            if self._depth_ahead(plan, op) < 1 or self.passes.cut_at_eos(op.draft.tokens)[1]:
                continue
            generator = request.generator
            if request.regime == "sampling":
                generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=request.generator)))
            shadow = dataclasses.replace(request, generator=generator)  # same sequence, stats and controller
            origin[shadow] = b
        if not origin:
            return self.passes.verify(index, ops)
        started = self.passes.clock()
        deadline = started + self._target_seconds if interrupt else None  # when the target's pass should be done
        for shadow, b in origin.items():
            plan = plans[ops[b].request]
            every = self.on_own_device(plan.chain[-2]) if outcomes is None else outcomes
            rounds[shadow] = self._outcomes(plan, shadow, ops[b], deadline if every else -math.inf)
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="cascade-ahead")
        stop = threading.Event() if interrupt else None
        future = self._ahead_pool.submit(self._drive_ahead, rounds, stop)
        try:
            verdicts = self.passes.verify(index, ops)
            seconds = self.passes.clock() - started
            self._target_seconds = seconds if not self._target_seconds else 0.8 * self._target_seconds + 0.2 * seconds
        except BaseException:
            if stop is not None:
                stop.set()
            future.exception()  # the stages below are still in use: wait for them, then fail as the target did
            raise
        if stop is not None:
            stop.set()  # the drafting ahead may not make the step wait beyond the pass it is in
        drafted = future.result()
        for shadow, drafts in drafted.items():  # per request, its drafts by outcome
            op, verdict = ops[origin[shadow]], verdicts[origin[shadow]]
            op.request.stats.drafted_ahead += 1
            guess, plan, draft = drafts.get(verdict.accepted, (None, None, None))
            if draft is not None and draft.tokens and not verdict.branched and guess == verdict.tokens[-1]:
                at = len(op.context) - len(op.draft.tokens) + verdict.accepted + 1
                rejected = verdict.accepted < len(op.draft.tokens)
                op.request.ahead = Ahead(at, plan, draft, rejected)
        return verdicts

    @staticmethod
    def _depth_ahead(plan: Plan, op: Verify) -> int:
        """What the round after ``op``'s drafts, at most: the plan's depth, within what the request still wants."""
        after = op.request.max_tokens - len(op.request.generated) - len(op.draft.tokens) - 1  # wanted after the round
        return min(plan.depths[-1], after - 1)

    def _outcomes(self, plan: Plan, request: Request, op: Verify, deadline: float | None
                  ) -> Generator[Verify | ModelDraft, object, dict[int, tuple[int, Plan, Draft]]]:
        """The next round's drafts for the outcomes of the target's verification of ``op``, drafted while it runs:
        per ``j`` (the draft's tokens the target may accept: 0 to all of them), the token the drafting stage guesses
        the target commits after them, and ``depth`` tokens drafted after that guess.

        First the whole draft accepted: the stage drafts ``depth + 1`` tokens after it, the first a guess at the
        target's bonus token (as before there were other outcomes). Then, while the target's pass lasts (on separate
        devices the stage would otherwise wait), the other outcomes: the stage scores its own draft (one pass over
        positions it has cached but the last), guesses at each position j the token the target commits if it rejects
        the draft's token there (the stage's likeliest other token, as its rows rank them), and drafts ``depth``
        tokens after ``draft[:j] + [guess]``, the earliest rejection first (a rejection at j needs the j tokens before
        it accepted), with the chain's bottom model alone where that is a model below the drafting stage (its draft
        goes straight to the target; the next round then runs that shorter chain). Every guess is fixed before the
        target's pass decides anything. Only the draft for the outcome that happens can be kept, so one round starts
        from at most one of them; each was drawn with this request's own generator after the guess, on exactly the
        context it will be verified on (module docstring).
        Another outcome is drafted only where it should be done before the target's pass (``deadline``, from the
        target's recent passes; None: every outcome, whatever the timing; −inf: the whole draft accepted only).
        Measured on the emulated MI300X chain (small → target at depth 4, one request, greedy): drafts made ahead kept
        in 81% of rounds instead of 20%, 1.10× the synchronous rounds' tokens/s instead of 1.02×
        (docs/ray-and-deployment.md).
        """
        drafter, pos, k, depth = plan.chain[-2], len(plan.chain) - 2, len(op.draft.tokens), self._depth_ahead(plan, op)
        drafts: dict[int, tuple[int, Plan, Draft]] = {}
        started = self.passes.clock()
        try:  # all k accepted: the stage's next token guesses the bonus, then the draft after it
            ahead = yield from self._propose(plan, pos, request, op.context, depth + 1, interruptible=True)
        except Interrupted:
            return drafts
        if len(ahead.tokens) > 1:
            drafts[k] = ahead.tokens[0], plan, ahead.after(1)
        # Another outcome only where it should be drafted before the target's pass is done (each takes about what
        # this one took): the step waits for a pass the drafting ahead has begun, and a draft cut short by the
        # target's pass is shorter than the round would draft itself.
        each = self.passes.clock() - started
        if len(ahead.tokens) <= depth or (deadline is not None and self.passes.clock() + 2 * each > deadline):
            return drafts
        try:
            own = yield Verify(drafter, request, op.context, Draft(op.draft.tokens, op.draft.probs), alternatives=1)
        except Interrupted:
            return drafts
        base = op.context[: len(op.context) - k]
        # After a rejection the chain's bottom model drafts for the target alone, where it is a model: a middle
        # stage's rounds take about half the target's pass, and only one outcome would fit
        lower = plan
        if pos and self.passes.is_model[plan.chain[0]]:
            lower = Plan((plan.chain[0], plan.chain[-1]), (depth,), 0.0)
        for j, token in enumerate(own.tokens[:k]):  # the earlier rejections first: likelier, α^j·(1 − α)
            guess = token if token != op.draft.tokens[j] else (own.alternatives[j][:1] or (None,))[0]
            if guess is None:
                continue
            try:
                draft = yield from self._propose(lower, len(lower.chain) - 2, request,
                                                 [*base, *op.draft.tokens[:j], guess], depth, interruptible=True)
            except Interrupted:
                break
            if draft.tokens:
                drafts[j] = guess, lower, draft
            if len(draft.tokens) < depth or (deadline is not None and self.passes.clock() + each > deadline):
                break
        return drafts

    def _drive_ahead(self, rounds: dict[Request, Generator], stop: threading.Event | None) -> dict[Request, object]:
        torch.set_num_threads(AHEAD_THREADS)  # this thread's own (OpenMP's teams are per thread)
        return self.drive(rounds, stop=stop)
