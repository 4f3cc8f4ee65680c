"""The cascade engine: every stage drafts for the next, the target has the last word, all requests at once.

``propose(i, ctx, k)`` returns k tokens of stage i with, when sampling, the distribution each was drawn from:

- stage 0 samples them autoregressively (a model) or looks them up (the n-gram drafter, one-hot);
- stage i >= 1 runs rounds — draft from stage i-1, one forward pass of stage i, verify — until k tokens are out.
  The tokens of a verified round are distributed exactly as stage i, and the distribution each was drawn from
  is stage i's own ``p`` row; that row is the ``q`` the stage above verifies against. By induction the tokens
  the top commits follow the target: token for token its greedy decode, or its sampling distribution.

Batching (DESIGN.md, "The batched step"). Each request's round is that recursion written as a generator: where it
needs a stage's forward pass it *yields* the pass (:class:`Verify`, :class:`ModelDraft`) and receives its result.
One :meth:`CascadeEngine.step` drives every running request's generator until each is blocked on a pass, runs
the blocked passes of the lowest stage as one batched forward (and one batched verification), sends the results
back, and repeats until every request has committed its round. Requests with different chains and depths share
the forward passes of the stages they use. Nothing about a request's output depends on the batch: its drafts,
verification and random draws (from its own generator) are the same whichever requests share the forward passes.

Requests join between steps (at most ``max_running`` at once: each holds a KV-cache slot in every model stage);
a prompt is prefilled in chunks under the per-step token budget ``max_batched_tokens``, so that a long prompt does
not stall the requests that are decoding.

Pipelined (``pipeline=True``, ``runtime.pipeline``; DESIGN.md, "The pipelined form"). While the target verifies
a step's drafts, a second thread runs the stages below it: for every request whose target drafter is a model, they
draft ``k + 1`` tokens ahead on the context the target is verifying (context plus draft), the first of them a
guess at the target's bonus token. When the target accepts the whole draft and its bonus token equals that guess,
the request's next round starts from the other ``k`` tokens and their rows, without waiting for a drafter; else
they are dropped, and the drafters' caches roll back to the verified tokens by common prefix on their next pass.
Exactness: greedy, a draft only changes what is checked, never what is committed. Sampling, the next verification
must see drafts drawn from the distribution it is given, conditioned on exactly the verified prefix, with fresh
randomness: the tokens ahead come from the drafting stages' own rounds, so jointly they follow that stage's
autoregressive distribution, each with the row it was drawn from; they are drawn with a generator of their own
(seeded from the request's stream), independent of the target's acceptance and bonus draws; and whether they are
kept depends only on the first of them (it must equal the bonus) and on the target's draws. Given that the first
equals the bonus, the rest are therefore a fresh draw from the drafter conditioned on exactly the verified
prefix, and their rows are that distribution — the ``q`` the verification is given. A request with shared noise
(``coupled``) draws position t with the noise of (seed, t) whenever it is drafted, so ahead or not its text is the
same. Requests still share every forward pass: the target's pass covers the step's batch, and the drafting ahead of
the whole batch is one batched drive of the lower stages on the second thread.

Engine and requests know nothing about text; ``cascade.api`` turns prompts into tokens and tokens into text.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch

from cascade.batch_verify import Draft, Verdict, verify_greedy_batch, verify_sampling_batch
from cascade.controller import AdaptiveController, ControllerParams, GlobalStats, Plan
from cascade.controller.adaptive import LookupValue
from cascade.controller.checks import PipelineCheck
from cascade.controller.model import candidate_chains
from cascade.ops import Verifier
from cascade.sampling import SamplingParams, coupled_sample
from cascade.stages.base import Drafter, Scorer
from cascade.stages.draft import DraftSampling
from cascade.stats import RequestStats, RoundObserver, StageStats

Stage = Drafter | Scorer
PREFILL_SCALE = 4.0  # a step prefills at most this many times the plain budget: a long prompt still spreads over steps


@dataclass(slots=True, eq=False)
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
    finish_reason: str | None = None  # "stop" (EOS, or a stop string found by the caller), "length" or "abort"
    started: float = field(default_factory=time.perf_counter)
    ignore_eos: bool = False  # the target's EOS does not end it (it runs to max_tokens)
    min_tokens: int = 0  # the target's EOS is masked out until this many tokens are generated
    seed: int = 0  # its generator's seed; with ``coupled``, the key of its shared noise
    coupled: bool = False  # sampled with shared noise (seeded): its text is a function of seed, prompt and target
    prefilled: int = 0  # prompt tokens already in the target's cache
    width: int = 1  # positions the target verified in this request's last round (its share of a step's tokens)
    ahead: Ahead | None = None  # the pipelined mode's drafts for its next round, made while the target verified

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated  # a new list: where only its length matters, use ``length``

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def regime(self) -> str:
        """How its drafts are verified: ``greedy`` and ``coupled`` compare token ids, ``sampling`` is rejection
        sampling against the drafts' distributions."""
        return "greedy" if self.params.greedy else "coupled" if self.coupled else "sampling"

    @property
    def decoding(self) -> bool:
        """Prefilled: the target's next forward pass feeds the last prompt token (or later ones) and asks for
        logits."""
        return self.prefilled >= len(self.prompt) - 1


@dataclass(frozen=True, slots=True)
class Ahead:
    """Drafts for the target drafted while it verified the request's last round (the pipelined mode): valid for
    the round that starts when the request's context has ``at`` tokens, drafted by ``plan``'s chain below the target."""

    at: int
    plan: Plan
    draft: Draft


# ---- what a round asks of a stage ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verify:
    """One forward pass of ``stage`` over ``context`` (which ends with ``draft``), then verification of the draft
    against the ``len(draft) + 1`` rows it gives. An empty draft samples one token of the stage."""

    stage: int
    request: Request
    context: list[int]
    draft: Draft


@dataclass(frozen=True, slots=True)
class ModelDraft:
    """``depth`` tokens of the bottom model ``stage`` continuing ``context``, autoregressively and drawn as the
    request draws (stops after EOS): one call of the stage (``Scorer.draft``)."""

    stage: int
    request: Request
    context: list[int]
    depth: int


Round = Generator[Verify | ModelDraft, object, list[int]]


class Interrupted(Exception):
    """Thrown into the pipelined mode's drafting ahead when the target's pass it runs beside is done."""

_seq_ids = itertools.count()  # unique across engines, since engines may share stage objects


class CascadeEngine:
    """Runs requests through a chain of stages; ``stages[-1]`` is the target, ``depths[i]`` is stage i's depth.

    With ``controller`` parameters, every request gets an adaptive controller that picks the chain (which stages
    take part) and the depths for each round of the target, for the current load (the number of requests in the
    step); without, every round uses all stages and ``depths``.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        depths: Sequence[int],
        *,
        eos_token_id: int | Sequence[int] | None,
        controller: ControllerParams | None = None,
        observer: RoundObserver | None = None,
        verifier: Verifier | None = None,
        shortcut: bool = False,
        max_running: int = 64,
        max_batched_tokens: int = 512,
        pipeline: bool = False,
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
        if max_running < 1 or max_batched_tokens < 1:
            raise ValueError(f"max_running and max_batched_tokens must be >= 1, got {max_running}, {max_batched_tokens}")
        self.stages = list(stages)
        self.step_threads: int | None = None  # torch threads while a step runs (None: the caller's)
        self._tokens_per_request = 1.0  # tokens a decoding request commits per step, decayed over ~10 steps
        self.pipeline = pipeline
        self.ahead_threads = 1  # torch threads of the pipelined mode's drafting thread
        # Pipelined: the drafting ahead stops when the target's pass is done, keeping the rounds it finished (the step
        # never waits for it beyond one pass of a lower stage). False: it always drafts its full depth, so a seeded
        # request samples the same whatever the timing (reproducible under the same plans, as synchronously).
        self.interrupt_ahead = True
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._pipeline_check: PipelineCheck | None = None
        if pipeline and controller is not None:
            controller = dataclasses.replace(controller, pipelined=True)
            self._pipeline_check = PipelineCheck(controller)
        self._is_model = [isinstance(s, Scorer) for s in stages]
        self.depths = list(depths)
        self.fixed_plan = Plan(tuple(range(len(stages))), tuple(depths), 0.0)
        self.controller_params = controller
        # What requests taught the controller, per regime (Request.regime): acceptance, and the cost curve of every
        # stage. A pass over sampled requests costs more than the same pass over greedy ones: its logits are warped
        # and sampled, and its drafts rejection-sampled, over the whole vocabulary (measured on the demo family at
        # 64 requests: +19% for the target verifying 192 positions, +33% for the small drafter's passes). Priced at
        # greedy's costs, drafting at a temperature was predicted up to 50% faster under load than it ran.
        self.global_stats: dict[str, GlobalStats] = {}
        if controller is not None:
            self.global_stats = {
                regime: GlobalStats(len(stages), controller) for regime in ("greedy", "coupled", "sampling")
            }
        # Every id that ends a sequence (Llama 3.1 and Qwen2.5 list several in generation_config).
        if eos_token_id is None:
            self.eos_token_ids: tuple[int, ...] = ()
        else:
            self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(dict.fromkeys(eos_token_id))
        self.target: Scorer = stages[-1]
        self.vocab_size = self.target.vocab_size
        self.observer = observer
        self.verifier = verifier or Verifier()  # the one dispatch point for the verification op
        if shortcut and self._is_model[0]:
            raise ValueError(f"shortcut needs a model-free drafter (n-gram) at the bottom, not {stages[0].name!r}")
        self.shortcut = shortcut
        self._without_bottom = Plan(self.fixed_plan.chain[1:], self.fixed_plan.depths[1:], 0.0)
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- requests -----------------------------------------------------------------------------------------

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int | None = None, *,
        ignore_eos: bool = False, coupled: bool = False, min_tokens: int = 0,
    ) -> Request:
        """Validate and queue a request; it runs from the next :meth:`step` that has room for it.

        ``coupled`` (sampling only): shared-noise verification (DESIGN.md, "Randomness"). Every stage samples
        absolute position t with the same noise, keyed by ``(seed, t)``, and a draft is accepted when it equals the
        verifier's token, so the text is a pure function of seed, prompt and target whatever the plan, load or
        batch — at a small cost in acceptance against rejection sampling. Otherwise a seed fixes the request's
        random stream, which reproduces the text only under the same plans.

        ``min_tokens``: the target's end-of-sequence token gets probability 0 until that many tokens are generated
        (as transformers' ``min_new_tokens`` and vLLM's ``min_tokens``); the output is exactly the target's under that
        rule. Only the target's verification applies it: a drafted EOS is simply rejected."""
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {min_tokens!r}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt) + max_tokens > self.target.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the target's context window "
                f"of {self.target.max_context} tokens"
            )
        if seed is not None and not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator()
        generator.manual_seed(seed)
        stats = RequestStats([StageStats(s.name) for s in self.stages], prompt_tokens=len(prompt))
        request = Request(
            next(_seq_ids), list(prompt), params, max_tokens, generator, stats, None, ignore_eos=ignore_eos,
            seed=seed, coupled=coupled and not params.greedy, min_tokens=min_tokens if self.eos_token_ids else 0,
        )
        if self.controller_params is not None:
            model_free = [not m for m in self._is_model]
            initial, chains = self.fixed_plan, None
            if self.shortcut:  # the n-gram drafter takes every round it finds a match for; plan the others
                initial = self._without_bottom
                chains = tuple(c for c in candidate_chains(len(self.stages)) if c[0] != 0)
            request.controller = AdaptiveController(
                self.global_stats[request.regime], model_free, initial, self.controller_params, chains
            )
        self.waiting.append(request)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[tuple[Request, list[int]]]:
        """Admit waiting requests while there is room, prefill a chunk of the new prompts, and run one round of the
        target for every prefilled request, all of them batched. Returns each running request with the tokens it
        committed this step (none while it is still prefilling); finished requests leave the running set."""
        if self.step_threads is None:
            return self._step()
        before = torch.get_num_threads()  # a setting of the calling thread (OpenMP's), restored for its caller
        torch.set_num_threads(self.step_threads)
        try:
            return self._step()
        finally:
            torch.set_num_threads(before)

    def _step(self) -> list[tuple[Request, list[int]]]:
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            # what the target holds of its prompt already (a retired sequence that began alike) is not prefilled
            request.prefilled = min(self.target.adopt(request.seq_id, request.prompt), len(request.prompt) - 1)
            self.running.append(request)
        ready = [r for r in self.running if r.decoding]
        prefilled = self._prefill([r for r in self.running if not r.decoding], budget=self._prefill_budget(ready))
        for stats in self.global_stats.values():
            stats.observe_prefill(prefilled)
        ready = [r for r in self.running if r.decoding]
        committed = dict.fromkeys(self.running, [])
        if ready:
            committed.update(self._decode(ready))
        for request in [r for r in self.running if r.finished]:
            self.finish(request)
        return list(committed.items())

    def finish(self, request: Request, reason: str | None = None) -> None:
        """Mark a request finished (``reason`` overrides, e.g. a stop string), take it out of the running set or
        the queue, and free its caches."""
        if reason is not None or request.finish_reason is None:
            request.finish_reason = reason or "abort"
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.stats.seconds = time.perf_counter() - request.started
        request.stats.verifier = self.verifier.chosen
        for stage, is_model in zip(self.stages, self._is_model):
            if is_model:
                stage.release(request.seq_id)

    def abort_all(self) -> list[Request]:
        """Finish every running and waiting request as ``abort`` (after a stage failed mid-step)."""
        requests = [*self.running, *self.waiting]
        for request in requests:
            self.finish(request, "abort")
        return requests

    def run(self, request: Request) -> Request:
        """Step until ``request`` is finished (other running requests advance with it)."""
        while not request.finished:
            self.step()
        return request

    # ---- prefill ----------------------------------------------------------------------------------------------

    def _prefill_budget(self, ready: Sequence[Request]) -> int:
        """Prompt tokens this step may prefill: ``(max_batched_tokens − B)·E``, what B decoding requests would leave
        of the budget if they decoded plainly (one position each), times E, the tokens a request has been committing
        per step (at most ``PREFILL_SCALE``); never less than an eighth of the budget, so a prompt keeps moving under
        any load. So prompts get the share of the target's work per committed token that plain decoding gives them:
        speculation must not admit prompts more slowly than the target alone. (With drafted positions charged to the
        budget and E ignored, 64 greedy clients in a closed loop finished requests three times as often per step as
        the target alone, prompts queued, and the median time to first token was 1.2 s against its 0.13 s; now 0.24 s,
        at the price of longer steps while prompts are waiting.)"""
        plain = (self.max_batched_tokens - len(ready)) * min(self._tokens_per_request, PREFILL_SCALE)
        return max(int(plain), self.max_batched_tokens // 8, 1)

    def _prefill(self, requests: Sequence[Request], budget: int) -> int:
        """Feed the next chunk of each prompt (first come, first served within ``budget``) to the target, one
        batched forward; returns the tokens fed. The last prompt token is left to the first round, which needs its
        logits. Drafters are not prefilled: a drafter the controller bypasses never needs the prompt, and one that
        drafts catches up on its first forward pass (its cache is aligned by common prefix), at a fraction of the
        target's cost, which the controller's plans count (``GlobalStats.observe_prefill``)."""
        chunks: list[tuple[Request, int]] = []
        for request in requests:
            if budget <= 0:
                break
            upto = min(len(request.prompt) - 1, request.prefilled + budget)
            budget -= upto - request.prefilled
            chunks.append((request, upto))
        if not chunks:
            return 0
        target = len(self.stages) - 1
        started = time.perf_counter()
        self.target.score([r.seq_id for r, _ in chunks], [r.prompt[:upto] for r, upto in chunks], [0] * len(chunks))
        tokens = sum(upto - r.prefilled for r, upto in chunks)
        self._record_forward(target, [r for r, _ in chunks], tokens, time.perf_counter() - started, fit=False)
        for request, upto in chunks:
            request.prefilled = upto
        return tokens

    # ---- one round for every ready request ----------------------------------------------------------------

    def _decode(self, ready: list[Request]) -> dict[Request, list[int]]:
        started = time.perf_counter()
        if self._pipeline_check is not None:  # plan for the mode the step is expected to run
            for stats in self.global_stats.values():
                stats.pipelining = self._pipeline_check.favoured(len(ready))
        rounds: dict[Request, Round] = {}
        lookups: dict[Request, bool] = {}
        drafting: dict[str, list[bool]] = {}  # per regime: whether each request's models draft this round
        explored: dict[str, bool] = {}  # per regime of adaptive requests: whether one of them explores this round
        for regime, stats in self.global_stats.items():
            # what a check that drafts, or drafting after plain steps, would make the drafters catch up on first
            # (counted only where the controller asks)
            stats.backlog = functools.partial(self._backlog, ready, regime)
        plans = self._plans(ready)
        observed: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}  # plan -> [rounds, changed]
        for request, (plan, found) in plans.items():
            context = request.context
            chain = [self.stages[i].name for i in plan.chain]
            changed = request.stats.record_plan(chain, plan.depths)
            if self.observer is not None:
                counts = observed.setdefault((plan.chain, plan.depths), [0, 0])
                counts[0] += 1
                counts[1] += changed
            remaining = request.max_tokens - len(request.generated)
            lookups[request] = plan.chain[0] == 0 and self.shortcut  # only the shortcut's rounds include it
            if request.controller is not None:
                decided = found is None  # (a found continuation or a draft made ahead: no decision this step)
                exploring = decided and request.controller.explored
                explored[request.regime] = explored.get(request.regime, False) or exploring
                if not lookups[request]:
                    drafting.setdefault(request.regime, []).append(len(plan.chain) > 1)
            rounds[request] = self._top_round(plan, request, context, remaining, found)
        for (chain, depths), (count, changed) in observed.items():
            self.observer.on_plan([self.stages[i].name for i in chain], depths, count, changed)
        # Pipelined: draft ahead in this step? Under the adaptive controller, as observed to pay at this load.
        eligible = self.pipeline and any(len(p.chain) > 1 and self._is_model[p.chain[-2]] for p, _ in plans.values())
        ahead = eligible and (self._pipeline_check is None or self._pipeline_check.ahead(len(ready)))
        results = self._drive(rounds, {r: plan for r, (plan, _) in plans.items()} if ahead else None)
        seconds = time.perf_counter() - started
        committed: dict[Request, list[int]] = {}
        for request, tokens in results.items():
            tokens = tokens[: request.max_tokens - len(request.generated)]
            if not request.ignore_eos:
                tokens, _ = self._cut_at_eos(tokens)  # an accepted EOS may be followed by a bonus token
            request.generated.extend(tokens)
            request.stats.generated_tokens = len(request.generated)
            if not request.ignore_eos and tokens and tokens[-1] in self.eos_token_ids:
                request.finish_reason = "stop"
            elif len(request.generated) >= request.max_tokens:
                request.finish_reason = "length"
            committed[request] = tokens
        # The step's rate, for the controller's checks at this load of found continuations against none and of
        # drafting against plain decoding. A step where a request explored says nothing about either; nor, about
        # drafting, one where only some requests' models drafted. One where found continuations were verified counts
        # for the mode the other requests' models ran: that is the step either mode makes under the shortcut, and
        # under load nearly every step verifies some (traced at 64 greedy requests, the few steps without any were
        # the only ones observed, at unusual moments, and said drafting paid while its steps ran 20% slower).
        total = sum(len(tokens) for tokens in committed.values())
        self._tokens_per_request = 0.9 * self._tokens_per_request + 0.1 * total / len(ready)
        if eligible and self._pipeline_check is not None:
            self._pipeline_check.observe(len(ready), ahead, total, seconds)
        looked_up = any(lookups.values())
        for regime, exploring in explored.items():  # before the observations end a check
            stats = self.global_stats[regime]
            stats.observe_spending(len(ready), total, seconds, exploring or stats.checked)
            if self.shortcut:
                stats.lookups.observe(len(ready), None if exploring else looked_up, total, seconds)
            drafted = drafting.get(regime, [])
            alike = not exploring and drafted and (all(drafted) or not any(drafted))
            stats.drafting.observe(len(ready), drafted[0] if alike else None, total, seconds)
        if self.observer is not None:
            self.observer.on_step(len(ready), sum(r.width for r in ready))
        return committed

    def _backlog(self, ready: Sequence[Request], regime: str) -> list[int]:
        """Per stage, the tokens of the contexts of ``ready``'s requests of ``regime`` it has not read (model drafters
        only; 0 for the rest)."""
        requests = [r for r in ready if r.regime == regime]
        backlog = [0] * len(self.stages)
        for index, stage in enumerate(self.stages[:-1]):
            if self._is_model[index]:
                backlog[index] = sum(max(r.length - stage.cached_tokens(r.seq_id), 0) for r in requests)
        return backlog

    def _plans(self, ready: Sequence[Request]) -> dict[Request, tuple[Plan, Draft | None]]:
        """Each request's chain and depths for this step, and the draft it already has: the one the pipelined mode
        drafted ahead for it (with the plan that drafted it), or the n-gram continuation the shortcut found (None when
        it has none).

        With the shortcut, the n-gram drafter's lookup is free, so look first: a found continuation drafts straight
        for the target this round (the models between would only re-check it). Under the adaptive controller it is
        drafted as deep as pays and taken only while steps that verified such drafts are observed faster at this
        load than steps that verified none (``AdaptiveController.take_lookup``) and while the step's found
        continuations together gain more tokens than the seconds they add to the step are worth
        (``AdaptiveController.lookup_value``: under load every request of the step waits for the extra positions).
        Rounds without one are the models': the adaptive controller plans (and explores) only those, among the
        chains without the n-gram drafter; a fixed plan loses its bottom stage. Any chain per round keeps the output
        exact.
        """
        batch, tokens = len(ready), sum(r.width for r in ready)
        kept = {r: r.ahead for r in ready if r.ahead is not None and r.ahead.at == r.length}
        for request in ready:
            request.ahead = None
        depths: dict[Request, int] = {}  # how deep to look, per request that looks
        values: dict[Request, LookupValue] = {}  # what each found continuation is worth, where that decides
        take: dict[str, bool] = {}  # per regime: whether this step looks (the same for all its requests)
        for request in ready if self.shortcut else ():
            controller = request.controller
            if controller is None:
                depths[request] = self.fixed_plan.depths[0]
                continue
            if request.regime not in take:
                take[request.regime] = controller.take_lookup(batch)
            if take[request.regime]:
                value = controller.lookup_value(batch, tokens)
                depths[request] = value.depth
                if not value.probe:
                    values[request] = value
        # A continuation gains at most its value's best, G(depth). Where the step's best gains together cannot pay
        # for verifying at all, every one found would be declined below, so none is looked for (a lookup costs
        # ~10 us of a ~2 ms step at one client: at temperature 0.8 on the demo family, over half of those steps).
        # A check of found continuations takes them whatever they are worth (LookupValue.probe, not in ``values``):
        # otherwise a stale estimate of their acceptance would decline every one, and the check would never see them.
        if values and sum(v.gain(v.depth) for v in values.values() if v.depth) <= min(v.threshold for v in values.values()):
            depths.update(dict.fromkeys(values, 0))
        found: dict[Request, list[int]] = {}
        for request, depth in depths.items():
            draft = self._lookup(0, request, request.context, depth) if depth else []
            if draft:
                found[request] = draft
        gains = {r: v.gain(len(found[r])) for r, v in values.items() if r in found}
        if gains:
            threshold = max(values[r].threshold for r in gains)
            worth = sum(g for g in gains.values() if g > 0) > threshold
            for request, gain in gains.items():
                if not worth or gain <= 0:
                    del found[request]
        target = len(self.stages) - 1
        plans: dict[Request, tuple[Plan, Draft | None]] = {}
        for request in ready:
            if request in found:  # (before a draft made ahead: a match is often right for many tokens)
                plans[request] = Plan((0, target), (len(found[request]),), 0.0), Draft(found[request], None)
            elif request in kept:  # the pipelined mode drafted this round while the target verified the last
                plans[request] = kept[request].plan, kept[request].draft
            elif request.controller is not None:
                plans[request] = request.controller.decide(batch), None
            else:
                plans[request] = (self._without_bottom if self.shortcut else self.fixed_plan), None
        return plans

    def _drive(
        self, rounds: dict[Request, Round], ahead: dict[Request, Plan] | None = None, stop: threading.Event | None = None,
    ) -> dict[Request, object]:
        """Run every round to completion: the passes they are blocked on, lowest stage first, one batched forward
        per stage and kind at a time (so a stage's batch gathers every request that needs it at that point).
        ``ahead``: the pipelined mode's plans; the target's passes then run beside the next rounds' drafting.
        ``stop``: once set, the rounds still running are interrupted before their next pass (those that end with
        what they have return it; the others are dropped)."""
        pending: dict[Request, Verify | ModelDraft] = {}
        done: dict[Request, list[int]] = {}

        def advance(request: Request, value: object) -> None:
            try:
                pending[request] = rounds[request].send(value)
            except StopIteration as stop:
                done[request] = stop.value

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
            if kind and ahead is not None and stage == len(self.stages) - 1:
                results = self._verify_drafting_ahead(stage, group, ahead)
            else:
                results = self._verify(stage, group) if kind else self._model_drafts(stage, group)
            for op, result in zip(group, results):
                advance(op.request, result)
        return done

    # ---- the cascade, one request's round as a generator ----------------------------------------------------
    # ``plan.chain`` lists the stages taking part (bottom first); ``pos`` is a position in it, and the stage at
    # ``pos - 1`` drafts for the stage at ``pos`` with depth ``plan.depths[pos - 1]``.

    def _top_round(self, plan: Plan, request: Request, context: list[int], want: int, found: Draft | None) -> Round:
        tokens, _ = yield from self._round(plan, len(plan.chain) - 1, request, context, want, found)
        return tokens

    def _round(
        self, plan: Plan, pos: int, request: Request, context: list[int], want: int, found: Draft | None = None
    ) -> Generator[Verify | ModelDraft, object, tuple[list[int], torch.Tensor | None]]:
        """One round at the stage at ``pos``: draft from below, one forward pass, verify.

        ``found``: a draft this round already has (the n-gram shortcut's, or one drafted ahead), not drafted again.
        Returns the round's tokens (accepted drafts, then the recovered or bonus token) and, when sampling, the
        ``p`` row of this stage each was drawn from: [len(tokens), vocab].
        """
        index = plan.chain[pos]
        # A round yields at most depth + 1 tokens, so drafting more than want - 1 would be wasted.
        depth = min(plan.depths[pos - 1], want - 1) if pos > 0 else 0
        if depth <= 0:
            draft = Draft.empty()
        elif found is not None:
            draft = found.prefix(depth)
        else:
            draft = yield from self._propose(plan, pos - 1, request, context, depth)
        verdict: Verdict = yield Verify(index, request, context + draft.tokens, draft)
        if pos == len(plan.chain) - 1:
            request.width = len(draft.tokens) + 1
        if pos > 0:
            drafter = plan.chain[pos - 1]
            request.stats.stages[drafter].record_draft(len(draft.tokens), verdict.accepted)
            if self.observer is not None:
                self.observer.on_draft(self.stages[drafter].name, len(draft.tokens), verdict.accepted)
            if request.controller is not None:
                request.controller.observe_round(drafter, index, len(draft.tokens), verdict.accepted, verdict.expected)
        request.stats.stages[index].rounds += 1
        return verdict.tokens, verdict.rows

    def _propose(
        self, plan: Plan, pos: int, request: Request, context: list[int], k: int, interruptible: bool = False
    ) -> Generator[Verify | ModelDraft, object, Draft]:
        """k tokens (fewer only after EOS, or from the n-gram drafter) of the stage at ``pos``, with p rows.
        ``interruptible``: :class:`Interrupted` thrown in between its rounds ends it with the tokens of the rounds
        done (the pipelined mode's drafting ahead, stopped when the target's pass is done)."""
        index = plan.chain[pos]
        if pos == 0 and not self._is_model[index]:
            return Draft(self._lookup(index, request, context, k), None)
        if pos == 0:  # the bottom model's whole draft in one call of the stage (a remote stage: one round trip)
            return (yield ModelDraft(index, request, context, k))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < k:
            try:
                new, new_rows = yield from self._round(plan, pos, request, context + tokens, k - len(tokens))
            except Interrupted:
                if not interruptible:
                    raise
                break
            tokens.extend(new)
            if new_rows is not None:
                rows.append(new_rows)
            tokens, ended = self._cut_at_eos(tokens)
            if ended:
                break
        tokens = tokens[:k]
        probs = torch.cat(rows)[: len(tokens)] if rows else None
        return Draft(tokens, probs)

    def _eos_masked(self, index: int, op: Verify) -> int:
        """How many of the op's rows must not give EOS: the target's rows for generated positions before the
        request's ``min_tokens``."""
        request = op.request
        if index != len(self.stages) - 1 or not request.min_tokens:
            return 0
        first = len(op.context) - len(op.draft.tokens) - len(request.prompt)  # the generated index of row 0
        return max(0, min(request.min_tokens - first, len(op.draft.tokens) + 1))

    def _mask_eos(self, logits: torch.Tensor, count: int) -> torch.Tensor:
        """``logits`` [rows, vocab] with EOS impossible in the first ``count`` rows (a copy when it changes)."""
        if not count:
            return logits
        forbidden = torch.zeros_like(logits, dtype=torch.bool)
        forbidden[:count, list(self.eos_token_ids)] = True
        return logits.masked_fill(forbidden, float("-inf"))

    @staticmethod
    def _chosen(op: Verify, logits: torch.Tensor) -> torch.Tensor:
        """The token each of a greedy or coupled op's rows gives [rows]: row j is absolute position
        ``len(context) - len(draft) + j`` of the request's sequence."""
        request = op.request
        if request.params.greedy:
            return logits.argmax(-1)
        return coupled_sample(logits, request.params, request.seed, len(op.context) - len(op.draft.tokens))

    def _cut_at_eos(self, tokens: list[int]) -> tuple[list[int], bool]:
        end = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
        if end is not None:
            return tokens[: end + 1], True
        return tokens, False

    def _lookup(self, index: int, request: Request, context: list[int], k: int) -> list[int]:
        """Up to k tokens from the model-free drafter at ``index``, its time recorded like a forward pass."""
        started = time.perf_counter()
        tokens = self.stages[index].propose([context], [k])[0][:k]
        seconds = time.perf_counter() - started
        if self.global_stats:
            self.global_stats[request.regime].costs[index].add(1, seconds, plain=True)
        if self.observer is not None:
            self.observer.on_forward(self.stages[index].name, 1, seconds)
        return tokens

    # ---- batched passes ---------------------------------------------------------------------------------------

    def _record_forward(
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
        regimes = {request.regime for request in requests} if fit and self.global_stats else set()
        costs = [self.global_stats[regime].costs[index] for regime in regimes]
        for _ in range(passes):
            for cost in costs:
                cost.add(tokens, seconds / passes, plain)
            if self.observer is not None:
                self.observer.on_forward(self.stages[index].name, tokens, seconds / passes)

    def _model_drafts(self, index: int, ops: Sequence[ModelDraft]) -> list[Draft]:
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
        started, computed = time.perf_counter(), stage.new_tokens
        drafts = stage.draft(
            [op.request.seq_id for op in ops], [op.context for op in ops], [op.depth for op in ops],
            self.eos_token_ids, sampling,
        )
        passes = max(len(tokens) for tokens, _ in drafts)
        per_pass = max(1, round((stage.new_tokens - computed) / passes))
        self._record_forward(index, [op.request for op in ops], per_pass, time.perf_counter() - started, passes=passes)
        return [Draft(tokens, rows) for tokens, rows in drafts]

    def _verify_drafting_ahead(self, index: int, ops: Sequence[Verify], plans: dict[Request, Plan]) -> list[Verdict]:
        """The target's batched pass over ``ops`` and, beside it on a second thread, the next round's drafts of every
        request whose plan has a model drafting for the target (the pipelined mode; the module docstring says why
        the output stays exact). Drafted ahead, a request's stages draft one token more than its plan's depth — the
        first a guess at the bonus token — on the context the target verifies, with a generator of their own."""
        rounds: dict[Request, Generator] = {}
        origin: dict[Request, int] = {}  # the op each round drafts after
        for b, op in enumerate(ops):
            request, plan = op.request, plans.get(op.request)
            if plan is None or len(plan.chain) < 2 or not self._is_model[plan.chain[-2]] or not op.draft.tokens:
                continue
            after = request.max_tokens - len(request.generated) - len(op.draft.tokens) - 1  # wanted after this round
            depth = min(plan.depths[-1], after - 1)  # what the next round drafts, at most
            if depth < 1 or self._cut_at_eos(op.draft.tokens)[1]:
                continue
            generator = request.generator
            if request.regime == "sampling":
                generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=request.generator)))
            shadow = dataclasses.replace(request, generator=generator)  # same sequence, stats and controller
            rounds[shadow] = self._propose(plan, len(plan.chain) - 2, shadow, op.context, depth + 1, interruptible=True)
            origin[shadow] = b
        if not rounds:
            return self._verify(index, ops)
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="cascade-ahead")
        stop = threading.Event() if self.interrupt_ahead else None
        future = self._ahead_pool.submit(self._drive_ahead, rounds, stop)
        try:
            verdicts = self._verify(index, ops)
        except BaseException:
            if stop is not None:
                stop.set()
            future.exception()  # the stages below are still in use: wait for them, then fail as the target did
            raise
        if stop is not None:
            stop.set()  # the drafting ahead may not make the step wait beyond the pass it is in
        drafted = future.result()
        for shadow, draft in drafted.items():
            op, verdict = ops[origin[shadow]], verdicts[origin[shadow]]
            op.request.stats.drafted_ahead += 1
            if verdict.accepted == len(op.draft.tokens) and len(draft.tokens) > 1 and draft.tokens[0] == verdict.tokens[-1]:
                op.request.ahead = Ahead(len(op.context) + 1, plans[op.request], draft.after(1))
                op.request.stats.kept_ahead += 1
        return verdicts

    def _drive_ahead(self, rounds: dict[Request, Generator], stop: threading.Event | None) -> dict[Request, object]:
        torch.set_num_threads(self.ahead_threads)  # this thread's own (OpenMP's teams are per thread)
        return self._drive(rounds, stop=stop)

    def _verify(self, index: int, ops: Sequence[Verify]) -> list[Verdict]:
        """One batched forward pass of stage ``index`` over every op's draft (plus the bonus position), then one
        batched verification of the ops whose drafts are compared by id (greedy and coupled: each row's token is its
        argmax, or its sample with the request's shared noise) and one of the rejection-sampling ops."""
        stage = self.stages[index]
        seq_ids = [op.request.seq_id for op in ops]
        contexts = [op.context for op in ops]
        positions = [len(op.draft.tokens) + 1 for op in ops]
        regimes = [op.request.regime for op in ops]
        masked = [self._eos_masked(index, op) for op in ops]  # [ops]: rows whose EOS min_tokens forbids
        started, computed = time.perf_counter(), stage.new_tokens
        # Rows stay on the stage's device: warping, sampling and verification run there, and only token ids and
        # counts cross to the host (the verification's one synchronisation, which also ends the pass's timing).
        if any(r != "greedy" for r in regimes) or any(masked):
            logits = stage.score(seq_ids, contexts, positions)  # [positions[b], vocab] each
            logits = [self._mask_eos(rows, count) for rows, count in zip(logits, masked)]
            chosen = [self._chosen(op, rows) if r != "sampling" else None for op, rows, r in zip(ops, logits, regimes)]
        else:
            chosen = stage.argmax(seq_ids, contexts, positions)  # [positions[b]] each
        verdicts: list[Verdict | None] = [None] * len(ops)
        by_id = [b for b, r in enumerate(regimes) if r != "sampling"]
        if by_id:
            drafts = [ops[b].draft.tokens for b in by_id]
            for b, verdict in zip(by_id, verify_greedy_batch(self.verifier, drafts, [chosen[b] for b in by_id])):
                verdicts[b] = verdict
        sampling = [b for b, r in enumerate(regimes) if r == "sampling"]
        if sampling:
            group = [ops[b] for b in sampling]
            found = verify_sampling_batch(
                self.verifier, [op.draft for op in group], [logits[b] for b in sampling],
                [op.request.params for op in group], [op.request.generator for op in group],
                [op.request.controller is not None for op in group],
            )
            for b, verdict in zip(sampling, found):
                verdicts[b] = verdict
        # The verification's time counts with the forward pass: the controller weighs what a round of this stage
        # costs, and at a sampling temperature warping and rejection are a fair part of it.
        # The pass is timed over the positions it computed: a drafter catching up on a context it has not seen (its
        # first round for a request, or one after it was bypassed) computes the whole context, not its draft.
        plain = all(n == 1 for n in positions)
        seconds = time.perf_counter() - started
        self._record_forward(index, [op.request for op in ops], max(stage.new_tokens - computed, 1), seconds, plain=plain)
        return verdicts
