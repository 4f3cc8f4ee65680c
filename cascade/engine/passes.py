"""What a round asks of a stage, and the batched passes that answer a whole step's asks at once.

A round (:mod:`cascade.engine.rounds`) yields :class:`Verify` (one forward pass of a model stage over a context
ending in a draft, then verification of that draft) or :class:`ModelDraft` (the bottom model's draft, one call of
the stage). :class:`StagePasses` runs every ask of one stage and kind in a step as one batched forward and one
batched verification, and records what each pass cost for the requests' statistics, the controller's cost curves
and the observer (the server's metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from cascade.clock import Clock
from cascade.controller.step import StepRecord
from cascade.engine.request import Request
from cascade.penalties import token_logprobs
from cascade.sampling import BROKEN_ROW, coupled_sample, finite_rows
from cascade.stages.base import LookupStage, ModelStage
from cascade.stages.draft import DraftSampling
from cascade.stats import RoundObserver
from cascade.sampling import warp_grouped
from cascade.verify import Draft, Verdict, Verifier, expected_acceptance, verify_matching, verify_sampling
from cascade.verify.tree import Flat, Walk, flatten, verify_trees_matching, verify_trees_sampling

Stage = LookupStage | ModelStage


@dataclass(frozen=True, slots=True)
class Verify:
    """One forward pass of ``stage`` over ``context`` (which ends with ``draft``), then verification of the draft
    against the ``len(draft) + 1`` rows it gives. An empty draft samples one token of the stage."""

    stage: int
    request: Request
    context: list[int]
    draft: Draft
    alternatives: int = 0  # the verdict lists, beside each committed token, up to this many of the stage's next
    # likeliest tokens at its row (Verdict.alternatives)


@dataclass(frozen=True, slots=True)
class ModelDraft:
    """``depth`` tokens of the bottom model ``stage`` continuing ``context``, autoregressively and drawn as the
    request draws (stops after EOS): one call of the stage (``ModelStage.draft``)."""

    stage: int
    request: Request
    context: list[int]
    depth: int
    siblings: int = 0  # up to this many branch nodes per draft token, the stage's likeliest paths beside its own (a
    # draft tree: cascade.verify.tree)


Round = Generator[Verify | ModelDraft, object, list[int]]


class Interrupted(Exception):
    """Thrown into the pipelined mode's drafting ahead when the target's pass it runs beside is done."""


class StagePasses:
    """The stages' batched passes over a step's asks, and the record of what each cost: in each request's stats, in
    ``step_record`` (what the step in progress tells the adaptive controller when it ends; None without one) and to
    ``observer`` (told of every pass; None: nobody listens). ``clock``: what the passes are timed by (wall or emulated
    seconds)."""

    def __init__(
        self, stages: Sequence[Stage], verifier: Verifier, eos_token_ids: tuple[int, ...],
        observer: RoundObserver | None, clock: Clock | None = None,
    ):
        self.stages = list(stages)
        self.is_model = [isinstance(s, ModelStage) for s in stages]
        self.target = len(stages) - 1  # the target's index
        self.verifier = verifier
        self.eos_token_ids = eos_token_ids
        self.step_record: StepRecord | None = None  # set by the engine for each step
        self.observer = observer
        self.clock = clock or Clock()

    def cut_at_eos(self, tokens: list[int]) -> tuple[list[int], bool]:
        """``tokens`` up to and including the first EOS, and whether there was one."""
        end = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
        if end is not None:
            return tokens[: end + 1], True
        return tokens, False

    def record(
        self, index: int, requests: Sequence[Request], tokens: int, seconds: float, *, passes: int = 1, fit: bool = True,
        plain: bool = True,
    ) -> None:
        """``passes`` batched forward passes of stage ``index`` over ``tokens`` positions each took ``seconds``;
        each request's statistics get its share of the time. ``fit``: a round's pass, which the controller's cost
        model describes (a prefill chunk is not), in the curves of its requests' regimes (a pass that mixes regimes
        costs what it costs for each: the step is theirs together); ``plain``: it verified no draft (the model keeps
        a curve for each kind)."""
        for request in requests:
            stats = request.stats.stages[index]
            stats.forward_seconds += seconds / len(requests)
            stats.forward_passes += passes
        record = self.step_record if fit else None
        regimes = frozenset(request.regime for request in requests) if record is not None else frozenset()
        for _ in range(passes):
            if record is not None:
                record.on_pass(index, tokens, seconds / passes, plain, regimes)
            if self.observer is not None:
                self.observer.on_forward(self.stages[index].name, tokens, seconds / passes)

    def lookup(self, index: int, request: Request, context: list[int], k: int, branches: int = 0) -> Draft:
        """Up to k tokens from the model-free drafter at ``index`` (with up to ``branches`` other continuations as
        draft-tree branches), its time recorded like a forward pass."""
        started = self.clock()
        stage = self.stages[index]
        scoped = {"scopes": [request.scope]} if hasattr(stage, "learn") else {}  # (a drafter learning across requests)
        if branches:
            [(tokens, tree)] = stage.propose_tree([context], [k], branches, **scoped)
            draft = Draft(tokens[:k], None, tuple(tree))
        else:
            draft = Draft(stage.propose([context], [k], **scoped)[0][:k], None)
        seconds = self.clock() - started
        if self.step_record is not None:
            self.step_record.on_pass(index, 1, seconds, True, frozenset((request.regime,)))
        if self.observer is not None:
            self.observer.on_forward(self.stages[index].name, 1, seconds)
        return draft

    def drafts(self, index: int, ops: Sequence[ModelDraft]) -> list[Draft]:
        """Every op's draft from the bottom model ``index``, in one call of the stage."""
        stage = self.stages[index]
        sampling = []
        for op in ops:  # how each request draws (cascade.stages.draft): independent samples take their uniforms
            request = op.request  # from the request's generator, one per draft token
            if request.regime == "greedy":
                sampling.append(None)
            elif request.regime == "coupled":
                sampling.append(DraftSampling(request.params, seed=request.seed))
            else:
                uniforms = torch.rand(op.depth, generator=request.generator).tolist()
                sampling.append(DraftSampling(request.params, uniforms=tuple(uniforms)))
        started, computed = self.clock(), stage.new_tokens
        asked = ([op.request.seq_id for op in ops], [op.context for op in ops], [op.depth for op in ops],
                 self.eos_token_ids, sampling)
        siblings = max(op.siblings for op in ops)
        if siblings:  # (only a stage that scores trees is asked for siblings: StagePasses.scores_trees)
            drafts = [d if op.siblings else Draft(d.tokens, d.probs) for op, d in zip(ops, stage.draft_tree(*asked, siblings))]
        else:
            drafts = [Draft(tokens, rows) for tokens, rows in stage.draft(*asked)]
        passes = max(1, max(len(d.tokens) for d in drafts))  # (0: every draft stopped at a broken row)
        per_pass = max(1, round((stage.new_tokens - computed) / passes))
        self.record(index, [op.request for op in ops], per_pass, self.clock() - started, passes=passes)
        return drafts

    def proposes_trees(self, drafter: int) -> bool:
        """Whether the stage at ``drafter`` can propose draft trees (stages in this process with the lean forward,
        and the model-free drafters; a remote stage proposes chains)."""
        return hasattr(self.stages[drafter], "draft_tree" if self.is_model[drafter] else "propose_tree")

    def scores_trees(self, verifier: int) -> bool:
        """Whether the stage at ``verifier`` can score a draft tree in one pass (the lean forward, in this process)."""
        return bool(getattr(self.stages[verifier], "scores_trees", False))

    def verify(self, index: int, ops: Sequence[Verify]) -> list[Verdict]:
        """One batched forward pass of stage ``index`` over every op's draft (plus the bonus position), then one
        batched verification of the ops whose drafts are compared by id (greedy and coupled: each row's token is its
        argmax, or its sample with the request's shared noise) and one of the rejection-sampling ops."""
        stage = self.stages[index]
        if any(op.draft.branches for op in ops):
            return self._verify_trees(index, ops)
        seq_ids = [op.request.seq_id for op in ops]
        contexts = [op.context for op in ops]
        positions = [len(op.draft.tokens) + 1 for op in ops]
        regimes = [op.request.regime for op in ops]
        masked = [self._eos_masked(index, op) for op in ops]  # [ops]: rows whose EOS min_tokens forbids
        by_id = [b for b, r in enumerate(regimes) if r != "sampling"]  # verified by matching (greedy, coupled)
        started, computed = self.clock(), stage.new_tokens
        # Rows stay on the stage's device: warping, sampling and verification run there, and only token ids and
        # counts cross to the host (the verification's one synchronisation, which also ends the pass's timing).
        target = index == self.target
        if any(masked) or any(op.alternatives or (op.request.target_rows if target else r != "greedy")
                              for op, r in zip(ops, regimes)):
            raw = stage.score(seq_ids, contexts, positions)  # [positions[b], vocab] each
            logits = [self._target_rows(op, rows, count) if target else rows for op, rows, count in zip(ops, raw, masked)]
            logits = self._isolate_broken(index, ops, logits)
            chosen = dict(zip(by_id, self._chosen([ops[b] for b in by_id], [logits[b] for b in by_id])))
        else:
            chosen = stage.argmax(seq_ids, contexts, positions)  # [positions[b]] each
        verdicts: list[Verdict | None] = [None] * len(ops)
        if by_id:
            drafts = [ops[b].draft.tokens for b in by_id]
            for b, verdict in zip(by_id, verify_matching(self.verifier, drafts, [chosen[b] for b in by_id])):
                if BROKEN_ROW in verdict.tokens:  # the stage's argmax of a row that was not finite
                    self._fail(index, ops[b].request)
                    verdict = Verdict([0], None, 0, None)  # (dropped at commit)
                verdicts[b] = verdict
        sampling = [b for b, r in enumerate(regimes) if r == "sampling"]
        if sampling:
            group = [ops[b] for b in sampling]
            found = verify_sampling(
                self.verifier, [op.draft for op in group], [logits[b] for b in sampling],
                [op.request.params for op in group], [op.request.generator for op in group],
                [op.request.acceptance is not None for op in group],
            )
            for b, verdict in zip(sampling, found):
                verdicts[b] = verdict
        if any(op.alternatives for op in ops):  # (then ``logits`` were scored above)
            verdicts = _with_alternatives(ops, verdicts, [rows[: len(v.tokens)] for rows, v in zip(logits, verdicts)])
        if target and any(op.request.logprobs is not None for op in ops):  # (then ``raw`` was scored above)
            for op, rows, verdict in zip(ops, raw, verdicts):
                if op.request.logprobs is not None and op.request.failure is None:
                    op.request.round_logprobs = token_logprobs(rows, verdict.tokens, op.request.logprobs)
        # The verification's time counts with the forward pass: the controller weighs what a round of this stage
        # costs, and at a sampling temperature warping and rejection are a fair part of it.
        # The pass is timed over the positions it computed: a drafter catching up on a context it has not seen (its
        # first round for a request, or one after it was bypassed) computes the whole context, not its draft.
        plain = all(n == 1 for n in positions)
        seconds = self.clock() - started
        self.record(index, [op.request for op in ops], max(stage.new_tokens - computed, 1), seconds, plain=plain)
        return verdicts

    def _verify_trees(self, index: int, ops: Sequence[Verify]) -> list[Verdict]:
        """A stage's pass over a step in which some drafts are trees (:mod:`cascade.verify.tree`): one forward pass
        scoring every tree's nodes and every chain's positions, then each tree verified on its own (greedy and
        coupled by matching, sampling by recursive rejection over siblings) and the chains as :meth:`verify` does.
        Trees are drafted only for requests whose target rows are its plain distribution (no penalties, logprobs or
        ``min_tokens``), so each row is verified as the stage computed it. A middle stage's verdict (its path
        through the tree, and when sampling the rows each token was drawn from) goes up as its draft, as a chain's
        does."""
        stage = self.stages[index]
        trees = [flatten(op.draft.tokens, op.draft.branches) if op.draft.branches else None for op in ops]
        contexts = [op.context[: len(op.context) - len(op.draft.tokens)] if tree else op.context
                    for op, tree in zip(ops, trees)]
        positions = [1 + len(tree.tokens) if tree else len(op.draft.tokens) + 1 for op, tree in zip(ops, trees)]
        started, computed = self.clock(), stage.new_tokens
        raw = stage.score_tree([op.request.seq_id for op in ops], contexts, positions, trees)
        target = index == self.target
        logits = [self._target_rows(op, rows, self._eos_masked(index, op)) if target and not tree else rows
                  for op, rows, tree in zip(ops, raw, trees)]
        logits = self._isolate_broken(index, ops, logits)
        verdicts: list[Verdict | None] = [None] * len(ops)
        chains = [b for b, tree in enumerate(trees) if tree is None]
        treed = [b for b, tree in enumerate(trees) if tree is not None]
        walked = self._verify_tree_batch([ops[b] for b in treed], [trees[b] for b in treed], [logits[b] for b in treed],
                                         [len(contexts[b]) for b in treed])
        paths = {}  # tree op -> the rows its committed tokens were chosen at
        for b, (verdict, path) in zip(treed, walked):
            verdicts[b], paths[b] = verdict, path
        by_id = [b for b in chains if ops[b].request.regime != "sampling"]
        if by_id:
            chosen = self._chosen([ops[b] for b in by_id], [logits[b] for b in by_id])
            for b, verdict in zip(by_id, verify_matching(self.verifier, [ops[b].draft.tokens for b in by_id], chosen)):
                verdicts[b] = verdict
        sampling = [b for b in chains if ops[b].request.regime == "sampling"]
        if sampling:
            found = verify_sampling(
                self.verifier, [ops[b].draft for b in sampling], [logits[b] for b in sampling],
                [ops[b].request.params for b in sampling], [ops[b].request.generator for b in sampling],
                [ops[b].request.acceptance is not None for b in sampling],
            )
            for b, verdict in zip(sampling, found):
                verdicts[b] = verdict
        if any(op.alternatives for op in ops):
            verdicts = _with_alternatives(ops, verdicts, [logits[b][paths[b]] if b in paths else logits[b][: len(v.tokens)]
                                                          for b, v in enumerate(verdicts)])
        for b in chains if target else ():  # (a request with logprobs always verifies a chain)
            op = ops[b]
            if op.request.logprobs is not None and op.request.failure is None:
                op.request.round_logprobs = token_logprobs(raw[b], verdicts[b].tokens, op.request.logprobs)
        seconds = self.clock() - started
        self.record(index, [op.request for op in ops], max(stage.new_tokens - computed, 1), seconds, plain=False)
        return verdicts

    def _verify_tree_batch(self, ops: Sequence[Verify], trees: Sequence[Flat], logits: Sequence[torch.Tensor],
                           bases: Sequence[int]) -> list[tuple[Verdict, list[int]]]:
        """The step's draft trees' verdicts from their ``[1 + nodes, vocab]`` rows, through the verifier's tree op
        (one call per regime), each with the rows its committed tokens were chosen at (row 0, then 1 + each node on
        its accepted path); ``bases``: each context's length before its tree. ``accepted`` counts the tokens kept on the spine (what the controller's acceptance of the chain learns
        from) and ``branched`` those kept on a branch after it."""
        verdicts: list[tuple[Verdict, list[int]] | None] = [None] * len(ops)
        matched = [i for i, op in enumerate(ops) if op.request.regime != "sampling"]
        if matched:
            # row 0 at the context's end, node n's row at its depth + 1 past it
            chosen = self._chosen([ops[i] for i in matched], [logits[i] for i in matched],
                                  [[bases[i]] + [bases[i] + d + 1 for d in trees[i].depths] for i in matched])
            walks = verify_trees_matching(self.verifier, [trees[i] for i in matched], chosen)
            for i, walk in zip(matched, walks):
                verdicts[i] = _tree_verdict(trees[i], walk, None, None), _path_rows(walk)
        sampled = [i for i, op in enumerate(ops) if op.request.regime == "sampling"]
        if sampled:
            p = warp_grouped([logits[i] for i in sampled], [ops[i].request.params for i in sampled])
            q = []
            for i, rows in zip(sampled, p):  # the spine's rows where it was sampled; branches: deterministic (zero)
                draft = ops[i].draft
                q.append(None if draft.probs is None else torch.cat([
                    draft.probs.to(rows.device), rows.new_zeros(len(trees[i].tokens) - len(draft.tokens), rows.shape[-1])
                ]))
            walks = verify_trees_sampling(self.verifier, [trees[i] for i in sampled], p, q,
                                          [ops[i].request.generator for i in sampled])
            watched = [j for j, i in enumerate(sampled) if ops[i].request.acceptance is not None]  # the spines'
            expected = dict(zip(watched, expected_acceptance(  # expected acceptance, for their controllers
                [p[j][: len(ops[sampled[j]].draft.tokens) + 1] for j in watched],
                [Draft(ops[sampled[j]].draft.tokens, ops[sampled[j]].draft.probs) for j in watched])))
            for j, (i, rows, walk) in enumerate(zip(sampled, p, walks)):
                path = _path_rows(walk)
                verdicts[i] = _tree_verdict(trees[i], walk, rows[path], expected.get(j)), path
        return verdicts

    def _isolate_broken(self, index: int, ops: Sequence[Verify], logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """A request whose rows are not finite (NaN or +inf: a model fault, fp16 overflow) would draw an index past
        the vocabulary and fail the batch's next pass for everyone. It fails alone: marked failed (the engine ends
        it with ``finish_reason`` ``error``), its rows replaced by zeros so the batch verifies as usual."""
        rows_ok = finite_rows(torch.cat(logits))  # [Σ positions]: one reduction over the step's rows
        healthy = [bool(ok.all()) for ok in rows_ok.split([rows.shape[0] for rows in logits])] \
            if not bool(rows_ok.all()) else [True] * len(logits)  # (one sync in the usual, healthy case)
        if all(healthy):
            return logits
        for b, ok in enumerate(healthy):
            if not ok:
                self._fail(index, ops[b].request)
                logits[b] = torch.zeros_like(logits[b])
        return logits

    def _fail(self, index: int, request: Request) -> None:
        request.failure = (
            f"stage {self.stages[index].name!r} computed non-finite logits (NaN or inf) for this request; it was "
            "stopped, and the requests batched with it went on"
        )

    def _eos_masked(self, index: int, op: Verify) -> int:
        """How many of the op's rows must not give EOS: the target's rows for generated positions before the
        request's ``min_tokens``."""
        request = op.request
        if index != self.target or not request.min_tokens:
            return 0
        first = len(op.context) - len(op.draft.tokens) - len(request.prompt)  # the generated index of row 0
        return max(0, min(request.min_tokens - first, len(op.draft.tokens) + 1))

    def _target_rows(self, op: Verify, logits: torch.Tensor, masked: int) -> torch.Tensor:
        """The target's rows [rows, vocab] of ``op`` as its request's distribution has them: penalised
        (:mod:`cascade.penalties`), then EOS impossible in the first ``masked`` rows (``min_tokens``)."""
        penalties = op.request.penalties
        if penalties is not None:
            before = len(op.context) - len(op.draft.tokens)
            logits = penalties.apply(logits, op.context[:before], len(op.request.prompt), op.draft.tokens)
        if not masked:
            return logits
        forbidden = torch.zeros_like(logits, dtype=torch.bool)
        forbidden[:masked, list(self.eos_token_ids)] = True
        return logits.masked_fill(forbidden, float("-inf"))

    @staticmethod
    def _chosen(ops: Sequence[Verify], logits: Sequence[torch.Tensor], positions: Sequence[list[int]] | None = None
                ) -> list[torch.Tensor]:
        """The token each of greedy or coupled ops' rows gives ([rows] per op; the coupled ones sampled together): row
        j is absolute position ``len(context) - len(draft) + j`` of the request's sequence, or ``positions[b][j]`` (a
        tree's rows)."""
        chosen = [rows.argmax(-1) if op.request.params.greedy else None for op, rows in zip(ops, logits)]
        coupled = [b for b, tokens in enumerate(chosen) if tokens is None]
        starts = [len(ops[b].context) - len(ops[b].draft.tokens) if positions is None else positions[b] for b in coupled]
        for b, tokens in zip(coupled, coupled_sample([logits[b] for b in coupled], [ops[b].request.params for b in coupled],
                                                     [ops[b].request.seed for b in coupled], starts)):
            chosen[b] = tokens
        return chosen


def _with_alternatives(ops: Sequence[Verify], verdicts: list[Verdict], rows: list[torch.Tensor]) -> list[Verdict]:
    """The verdicts of the ops that ask for alternatives with them: beside each committed token, up to
    ``op.alternatives`` of the next likeliest tokens of the logits ``rows[b]`` it was chosen at (the order of the
    stage's warped distribution too; a token the stage's logits exclude is never one). One ranking for the step."""
    asked = [b for b, op in enumerate(ops) if op.alternatives and verdicts[b] is not None]
    if not asked:
        return verdicts
    width = 1 + max(ops[b].alternatives for b in asked)
    top = torch.cat([rows[b] for b in asked]).topk(width, dim=-1)
    ids = top.indices.masked_fill(top.values == float("-inf"), -1).tolist()
    verdicts = list(verdicts)
    at = 0
    for b in asked:
        verdict, n = verdicts[b], ops[b].alternatives
        ranked = ids[at : at + len(verdict.tokens)]
        at += len(verdict.tokens)
        verdicts[b] = dataclasses.replace(verdict, alternatives=tuple(
            tuple([t for t in row if t != token and t >= 0][:n]) for token, row in zip(verdict.tokens, ranked)))
    return verdicts


def _path_rows(walk: Walk) -> list[int]:
    """The rows of a tree's pass its committed tokens were chosen at: row 0 (after the context), then 1 + each node
    on the accepted path."""
    return [0] + [1 + n for n in walk[1]]


def _tree_verdict(tree: Flat, walk: Walk, rows: torch.Tensor | None, expected: float | None) -> Verdict:
    """A tree's verdict from its walk; ``rows``: the row each committed token was drawn from (sampling)."""
    tokens, path = walk
    on_spine = next((i for i, n in enumerate(path) if n != i), len(path))
    rank = 0
    if on_spine < len(path):  # the rank of the sibling taken among its parent's children (the spine's is 0)
        taken = path[on_spine]
        rank = [n for n, parent in enumerate(tree.parents) if parent == tree.parents[taken]].index(taken)
    return Verdict(tokens, rows, on_spine, expected, len(path) - on_spine, rank)
