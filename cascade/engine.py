"""The synchronous cascade: every stage drafts for the next, the target has the last word (DESIGN.md).

``propose(i, ctx, k)`` returns k tokens of stage i with, when sampling, the distribution each was drawn from:

- stage 0 samples them autoregressively (a model) or looks them up (the n-gram drafter, one-hot);
- stage i >= 1 runs rounds — draft from stage i-1, one forward pass of stage i, verify — until k tokens are out.
  The tokens of a verified round are distributed exactly as stage i, and the distribution each was drawn from
  is stage i's own ``p`` row; that row is the ``q`` the stage above verifies against. By induction the tokens
  the top commits follow the target: token for token its greedy decode, or its sampling distribution.

Engine and requests know nothing about text; ``cascade.api`` turns prompts into tokens and tokens into text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cascade.controller import AdaptiveController, ControllerParams, GlobalStats, Plan
from cascade.controller.model import candidate_chains
from cascade.sampling import SamplingParams, sample_from, warp
from cascade.stages.base import Drafter, Scorer
from cascade.stats import RequestStats, RoundObserver, StageStats
from cascade.ops import Verifier

Stage = Drafter | Scorer


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]  # [depth]
    probs: torch.Tensor | None  # [depth, vocab]: the distribution each token was drawn from; None if greedy/one-hot

    @staticmethod
    def empty() -> Draft:
        return Draft([], None)


@dataclass(slots=True)
class Request:
    """One generation in flight: its tokens, its randomness, its controller and its statistics."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator
    stats: RequestStats
    controller: AdaptiveController | None  # None: the fixed plan
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS, or a stop string found by the caller) or "length"
    started: float = field(default_factory=time.perf_counter)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_seq_ids = itertools.count()  # unique across engines, since engines may share stage objects


class CascadeEngine:
    """Runs requests through a chain of stages; ``stages[-1]`` is the target, ``depths[i]`` is stage i's depth.

    With ``controller`` parameters, every request gets an adaptive controller that picks the chain (which stages
    take part) and the depths for each round of the target; without, every round uses all stages and ``depths``.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        depths: Sequence[int],
        *,
        eos_token_id: int | None,
        controller: ControllerParams | None = None,
        observer: RoundObserver | None = None,
        verifier: Verifier | None = None,
        shortcut: bool = False,
    ):
        if not stages:
            raise ValueError("a cascade needs at least one stage (the target)")
        if not isinstance(stages[-1], Scorer):
            raise ValueError(f"the target ({stages[-1].name!r}) must be a model stage")
        for i, stage in enumerate(stages[1:], start=1):
            if not isinstance(stage, Scorer):
                raise ValueError(f"stage {i} ({stage.name!r}) drafts without a model; only stage 0 may do that")
        if len(depths) != len(stages) - 1 or any(d < 1 for d in depths):
            raise ValueError(f"need a depth >= 1 for each of the {len(stages) - 1} drafting stages, got {list(depths)}")
        self.stages = list(stages)
        self._is_model = [isinstance(s, Scorer) for s in stages]
        self.depths = list(depths)
        self.fixed_plan = Plan(tuple(range(len(stages))), tuple(depths), 0.0)
        self.controller_params = controller
        self.global_stats = GlobalStats(len(stages), controller) if controller is not None else None
        self.eos_token_id = eos_token_id
        self.target: Scorer = stages[-1]
        self.vocab_size = self.target.vocab_size
        self.observer = observer
        self.verifier = verifier or Verifier()  # the one dispatch point for the verification op
        if shortcut and self._is_model[0]:
            raise ValueError(f"shortcut needs a model-free drafter (n-gram) at the bottom, not {stages[0].name!r}")
        self.shortcut = shortcut
        self._without_bottom = Plan(self.fixed_plan.chain[1:], self.fixed_plan.depths[1:], 0.0)

    # ---- requests -----------------------------------------------------------------------------------------

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int | None = None
    ) -> Request:
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt) + max_tokens > self.target.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the target's context window "
                f"of {self.target.max_context} tokens"
            )
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        stats = RequestStats([StageStats(s.name) for s in self.stages], prompt_tokens=len(prompt))
        controller = None
        if self.controller_params is not None:
            model_free = [not m for m in self._is_model]
            initial, chains = self.fixed_plan, None
            if self.shortcut:  # the n-gram drafter takes every round it finds a match for; plan the others
                initial = self._without_bottom
                chains = tuple(c for c in candidate_chains(len(self.stages)) if c[0] != 0)
            controller = AdaptiveController(self.global_stats, model_free, initial, self.controller_params, chains)
        return Request(next(_seq_ids), list(prompt), params, max_tokens, generator, stats, controller)

    def step(self, request: Request) -> list[int]:
        """One round of the target; returns the tokens it committed (at least one)."""
        assert not request.finished
        context = request.context
        plan, found = self._plan(request, context)
        chain = [self.stages[i].name for i in plan.chain]
        changed = request.stats.record_plan(chain, plan.depths)
        if self.observer is not None:
            self.observer.on_plan(chain, plan.depths, changed)
        remaining = request.max_tokens - len(request.generated)
        started = time.perf_counter()
        tokens, _ = self._round(plan, len(plan.chain) - 1, request, context, remaining, found)
        if self.shortcut and request.controller is not None:
            lookup = plan.chain[0] == 0  # only the shortcut's rounds include the n-gram drafter
            request.controller.observe_step(lookup, len(tokens), time.perf_counter() - started)
        tokens, _ = self._cut_at_eos(tokens[:remaining])  # an accepted EOS may be followed by a bonus token
        request.generated.extend(tokens)
        request.stats.generated_tokens = len(request.generated)
        if self.eos_token_id is not None and tokens and tokens[-1] == self.eos_token_id:
            request.finish_reason = "stop"
        elif len(request.generated) >= request.max_tokens:
            request.finish_reason = "length"
        return tokens

    def _plan(self, request: Request, context: list[int]) -> tuple[Plan, list[int] | None]:
        """This round's chain and depths, and the n-gram draft the shortcut found for it (None when it found none).

        With the shortcut, the n-gram drafter's lookup is free, so look first: when it finds a continuation, it
        drafts straight for the target this round (the models between would only re-check it; under the adaptive
        controller it drafts ``max_depth``, since a found continuation costs nothing to draft and little to
        verify, and only while such rounds are observed to pay: ``AdaptiveController.take_lookup``). Rounds without
        a match are the models': the adaptive controller plans (and explores) only those, among the chains
        without the n-gram drafter; a fixed plan loses its bottom stage. Any chain per round keeps the output
        exact.
        """
        controller = request.controller
        if self.shortcut and (controller is None or controller.take_lookup()):
            depth = self.fixed_plan.depths[0] if controller is None else self.controller_params.max_depth
            found = self._lookup(0, request, context, depth)
            if found:
                return Plan((0, len(self.stages) - 1), (depth,), 0.0), found
        if controller is not None:
            return controller.decide(), None
        return (self._without_bottom if self.shortcut else self.fixed_plan), None

    def finish(self, request: Request, reason: str | None = None) -> None:
        """Mark a request finished (``reason`` overrides, e.g. a stop string) and free its caches."""
        if reason is not None or request.finish_reason is None:
            request.finish_reason = reason or "abort"
        request.stats.seconds = time.perf_counter() - request.started
        request.stats.verifier = self.verifier.chosen
        for stage, is_model in zip(self.stages, self._is_model):
            if is_model:
                stage.release(request.seq_id)

    def run(self, request: Request) -> Request:
        while not request.finished:
            self.step(request)
        self.finish(request)
        return request

    # ---- the cascade ------------------------------------------------------------------------------------------
    # ``plan.chain`` lists the stages taking part (bottom first); ``pos`` is a position in it, and the stage at
    # ``pos - 1`` drafts for the stage at ``pos`` with depth ``plan.depths[pos - 1]``.

    def _cut_at_eos(self, tokens: list[int]) -> tuple[list[int], bool]:
        if self.eos_token_id is not None and self.eos_token_id in tokens:
            return tokens[: tokens.index(self.eos_token_id) + 1], True
        return tokens, False

    def _score(
        self, index: int, request: Request, context: list[int], num_positions: int, *, greedy: bool = False
    ) -> torch.Tensor:
        """One forward pass of stage ``index``: logits [num_positions, vocab], or with ``greedy`` only their
        argmax [num_positions] (all a greedy round needs; a remote stage then ships token ids, not rows)."""
        stage = self.stages[index]
        started = time.perf_counter()
        if greedy:
            out = stage.argmax([request.seq_id], [context], [num_positions])[0].cpu()  # [num_positions]
        else:
            out = stage.score([request.seq_id], [context], [num_positions])[0]  # [num_positions, vocab]
            if out.device.type != "cpu":
                # Verification runs on the host for now (GPU-resident verification comes with the kernels); the
                # copy also makes the measured time include the device's work.
                out = out.float().cpu()
        self._record_forwards(index, request, 1, num_positions, time.perf_counter() - started)
        return out

    def _record_forwards(self, index: int, request: Request, count: int, num_positions: int, seconds: float) -> None:
        """``count`` forward passes of stage ``index`` over ``num_positions`` positions each took ``seconds``."""
        stats = request.stats.stages[index]
        stats.forward_seconds += seconds
        stats.forward_passes += count
        for _ in range(count):
            if request.controller is not None:
                request.controller.observe_forward(index, num_positions, seconds / count)
            if self.observer is not None:
                self.observer.on_forward(self.stages[index].name, num_positions, seconds / count)

    def _lookup(self, index: int, request: Request, context: list[int], k: int) -> list[int]:
        """Up to k tokens from the model-free drafter at ``index``, its time recorded like a forward pass."""
        started = time.perf_counter()
        tokens = self.stages[index].propose([context], [k])[0][:k]
        seconds = time.perf_counter() - started
        if request.controller is not None:
            request.controller.observe_forward(index, 1, seconds)
        if self.observer is not None:
            self.observer.on_forward(self.stages[index].name, 1, seconds)
        return tokens

    def _propose(self, plan: Plan, pos: int, request: Request, context: list[int], k: int) -> Draft:
        """k tokens (fewer only after EOS, or from the n-gram drafter) of the stage at ``pos``, with p rows."""
        index = plan.chain[pos]
        if pos == 0 and not self._is_model[index]:
            return Draft(self._lookup(index, request, context, k), None)
        if pos == 0:
            return self._sample_autoregressive(index, request, context, k)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < k:
            new, new_rows = self._round(plan, pos, request, context + tokens, k - len(tokens))
            tokens.extend(new)
            if new_rows is not None:
                rows.append(new_rows)
            tokens, ended = self._cut_at_eos(tokens)
            if ended:
                break
        tokens = tokens[:k]
        probs = torch.cat(rows)[: len(tokens)] if rows else None
        return Draft(tokens, probs)

    def _sample_autoregressive(self, index: int, request: Request, context: list[int], k: int) -> Draft:
        if request.params.greedy:  # one call for the whole draft (a remote stage saves a round trip per token)
            started = time.perf_counter()
            tokens = self.stages[index].greedy_draft(request.seq_id, context, k, self.eos_token_id)
            self._record_forwards(index, request, len(tokens), 1, time.perf_counter() - started)
            return Draft(tokens, None)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._score(index, request, context + tokens, 1)  # [1, vocab]
            p = warp(logits, request.params)  # [1, vocab]
            token = int(sample_from(p, request.generator)[0])
            rows.append(p)
            tokens.append(token)
            if token == self.eos_token_id:
                break
        return Draft(tokens, torch.cat(rows))

    def _round(
        self, plan: Plan, pos: int, request: Request, context: list[int], want: int, found: list[int] | None = None
    ) -> tuple[list[int], torch.Tensor | None]:
        """One round at the stage at ``pos``: draft from below, one forward pass, verify.

        ``found``: a one-hot draft already looked up for this round (the n-gram shortcut's), not looked up again.
        Returns the round's tokens (accepted drafts, then the recovered or bonus token) and, when sampling, the
        ``p`` row of this stage each was drawn from: [len(tokens), vocab].
        """
        index = plan.chain[pos]
        # A round yields at most depth + 1 tokens, so drafting more than want - 1 would be wasted.
        depth = min(plan.depths[pos - 1], want - 1) if pos > 0 else 0
        if depth <= 0:
            draft = Draft.empty()
        elif found is not None:
            draft = Draft(found[:depth], None)
        else:
            draft = self._propose(plan, pos - 1, request, context, depth)
        n = len(draft.tokens)
        draft_ids = torch.tensor(draft.tokens, dtype=torch.long)  # [n]
        cu = torch.tensor([0, n])  # [batch + 1]
        expected = None
        if request.params.greedy:
            target_argmax = self._score(index, request, context + draft.tokens, n + 1, greedy=True)  # [n + 1]
            output, num_accepted = self.verifier.greedy(draft_ids, cu, target_argmax, n)
            rows = None
        else:
            logits = self._score(index, request, context + draft.tokens, n + 1)  # [n + 1, vocab]
            p = warp(logits, request.params)  # [n + 1, vocab]
            uniforms = torch.rand(n, generator=request.generator)  # [n]
            exponentials = torch.empty(1, p.shape[-1]).exponential_(generator=request.generator)  # [1, vocab]
            output, num_accepted = self.verifier.sampling(draft_ids, cu, draft.probs, p, uniforms, exponentials, n)
            rows = p
            if request.controller is not None and n:
                expected = expected_acceptance(p[:n], draft.probs, draft_ids)
        accepted = int(num_accepted[0])  # the one host synchronisation of the round
        tokens = output[0, : accepted + 1].tolist()
        if pos > 0:
            drafter = plan.chain[pos - 1]
            request.stats.stages[drafter].record_draft(n, accepted)
            if self.observer is not None:
                self.observer.on_draft(self.stages[drafter].name, n, accepted)
            if request.controller is not None:
                request.controller.observe_round(drafter, index, n, accepted, expected)
        request.stats.stages[index].rounds += 1
        return tokens, (rows[: accepted + 1] if rows is not None else None)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> float:
    """Σ_j (1 − TV(p_j, q_j)) = Σ_j Σ_x min(p_j(x), q_j(x)): the expected number of accepted positions if each
    were tested, observed without sampling noise. p, q: [n, vocab]; q None means one-hot drafts."""
    if q is None:
        return float(p.gather(1, draft_ids[:, None]).sum())
    return float(torch.minimum(p, q).sum())
