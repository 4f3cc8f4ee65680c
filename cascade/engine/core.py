"""The engine: requests join, are prefilled in chunks, and advance together, one round of the target per step.

One :meth:`CascadeEngine.step` admits waiting requests while there is room (at most ``max_running`` at once: each
holds a KV-cache slot in every model stage), feeds the next chunk of the new prompts to the target under the step's
token budget (``max_batched_tokens``, so a long prompt does not stall the requests that are decoding; a prompt whose
rest fits is computed in the step's verifying pass, with its first round), plans every
decoding request's round (:mod:`cascade.engine.planning`) and drives the rounds together, each stage's passes batched
(:mod:`cascade.engine.rounds`, which also states why the output is exactly the target's). What the step cost, and
what it committed, go back to the adaptive controller in one record (``cascade.controller.step``).

Engine and requests know nothing about text; ``cascade.api`` turns prompts into tokens and tokens into text.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Sequence

import torch

from cascade.clock import Clock
from cascade.controller import ControllerParams, Plan
from cascade.controller.step import StepController, StepPlan, StepRecord
from cascade.emulation import device_seconds_on_this_thread
from cascade.engine.passes import Round, Stage, StagePasses
from cascade.engine.planning import StepPlanner
from cascade.engine.request import Request, out_of_vocabulary
from cascade.engine.rounds import Rounds
from cascade.penalties import MAX_TOP_LOGPROBS, Penalties
from cascade.sampling import SamplingParams
from cascade.stages.base import ModelStage
from cascade.stats import RequestStats, RoundObserver, StageStats
from cascade.verify import Verifier

PREFILL_SCALE = 4.0  # a step prefills at most this many times the plain budget: a long prompt still spreads over steps

_seq_ids = itertools.count()  # unique across engines, since engines may share stage objects


class CascadeEngine:
    """Runs requests through a chain of stages; ``stages[-1]`` is the target, ``depths[i]`` is stage i's depth.

    With ``controller`` parameters, every request gets an adaptive controller that picks the chain (which stages
    take part) and the depths for each round of the target, for the current load (the number of requests in the
    step); without, every round uses all stages and ``depths``. ``siblings[i]``: when stage i (a model) drafts
    straight for the target, its draft is a tree of up to that many branch nodes per draft token
    (:mod:`cascade.verify.tree`).
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
        clock: Clock | None = None,
        siblings: Sequence[int] = (),
    ):
        if not stages:
            raise ValueError("a cascade needs at least one stage (the target)")
        if not isinstance(stages[-1], ModelStage):
            raise ValueError(f"the target ({stages[-1].name!r}) must be a model stage")
        for i, stage in enumerate(stages[1:], start=1):
            if not isinstance(stage, ModelStage):
                raise ValueError(f"stage {i} ({stage.name!r}) drafts without a model; only stage 0 may do that")
        if len(depths) != len(stages) - 1 or any(d < 1 for d in depths):
            raise ValueError(f"need a depth >= 1 for each of the {len(stages) - 1} drafting stages, got {list(depths)}")
        if max_running < 1 or max_batched_tokens < 1:
            raise ValueError(f"max_running and max_batched_tokens must be >= 1, got {max_running}, {max_batched_tokens}")
        if siblings and (len(siblings) != len(stages) or any(n < 0 for n in siblings)):
            raise ValueError(f"siblings: one count >= 0 per stage ({len(stages)}), got {list(siblings)}")
        if shortcut and isinstance(stages[0], ModelStage):
            raise ValueError(f"shortcut needs a model-free drafter (n-gram) at the bottom, not {stages[0].name!r}")
        self.stages = list(stages)
        self.clock = clock or Clock()  # every time recorded: wall seconds, or emulated ones (cascade.clock)
        self.step_seconds = 0.0  # wall seconds of the steps, and of them the host's: outside emulated passes
        self.host_seconds = 0.0
        self.target: ModelStage = stages[-1]
        self.vocab_size = self.target.vocab_size
        self.step_threads: int | None = None  # torch threads while a step runs (None: the caller's)
        self._tokens_per_request = 1.0  # tokens a decoding request commits per step, decayed over ~10 steps
        self.pipeline = pipeline
        # Pipelined: the drafting ahead stops when the target's pass is done, keeping the rounds it finished (the step
        # never waits for it beyond one pass of a lower stage). False: it always drafts its full depth, so a seeded
        # request samples the same whatever the timing (reproducible under the same plans, as synchronously).
        self.interrupt_ahead = True
        # The pipelined mode drafts ahead for every outcome of a verification (True), for all of the draft accepted
        # only (False), or for every outcome where the drafting stage has an accelerator of its own (None): on shared
        # cores the drafting ahead slows the target's pass, and more of it did (the CPU demo, adaptive: pipelined
        # 0.48x synchronous with every outcome, 0.94x with one).
        self.ahead_outcomes: bool | None = None
        fixed_plan = Plan(tuple(range(len(stages))), tuple(depths), 0.0)
        # Every id that ends a sequence (Llama 3.1 and Qwen2.5 list several in generation_config).
        if eos_token_id is None:
            self.eos_token_ids: tuple[int, ...] = ()
        else:
            self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(dict.fromkeys(eos_token_id))
        self.verifier = verifier or Verifier()  # the one dispatch point for the verification op
        self.shortcut = shortcut
        self.passes = StagePasses(self.stages, self.verifier, self.eos_token_ids, observer, self.clock)
        self.rounds = Rounds(self.passes, siblings)
        # The adaptive controller, the one object that plans steps and learns from them (cascade.controller.step).
        self.controller: StepController | None = None
        if controller is not None:
            if pipeline:
                controller = dataclasses.replace(controller, pipelined=True)
            # A stage with a roofline (emulated, or a real one with a `profile`) starts from its predicted costs.
            self.controller = StepController(
                controller, [not isinstance(s, ModelStage) for s in stages], fixed_plan, shortcut=shortcut,
                priors=[getattr(s, "cost_prior", None) for s in stages], trees=self.rounds.tree_edges,
            )
        found_trees = self.rounds.tree_edges.get((0, self.passes.target), 0)
        self.planner = StepPlanner(self.passes, fixed_plan, shortcut, self.controller, pipeline, found_trees)
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def observer(self) -> RoundObserver | None:
        """Told of every pass, draft, plan and step (the server's metrics); ``None``: nobody listens."""
        return self.passes.observer

    @observer.setter
    def observer(self, observer: RoundObserver | None) -> None:
        self.passes.observer = observer

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int | None = None, *,
        ignore_eos: bool = False, coupled: bool = False, min_tokens: int = 0, penalties: Penalties | None = None,
        logprobs: int | None = None, scope: str | None = None,
    ) -> Request:
        """Validate and queue a request; it runs from the next :meth:`step` that has room for it.

        ``coupled`` (sampling only): shared-noise verification (DESIGN.md, "Randomness"). Every stage samples
        absolute position t with the same noise, keyed by ``(seed, t)``, and a draft is accepted when it equals the
        verifier's token, so the text is a pure function of seed, prompt and target whatever the plan, load or
        batch — at a small cost in acceptance against rejection sampling. Otherwise a seed fixes the request's
        random stream, which reproduces the text only under the same plans.

        ``min_tokens``: the target's end-of-sequence token gets probability 0 until that many tokens are generated
        (as transformers' ``min_new_tokens`` and vLLM's ``min_tokens``); the output is exactly the target's under that
        rule. Only the target's verification applies it: a drafted EOS is simply rejected. ``penalties``: likewise
        the target's (:mod:`cascade.penalties`). ``logprobs``: record each generated token's log-probability under
        the target, with that many alternatives (``Request.token_logprobs``). ``scope``: a drafter that learns across
        requests (``cascade.stages.suffix``) drafts for it from earlier requests of the same scope only, and learns
        from it for them."""
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {min_tokens!r}")
        problem = out_of_vocabulary(prompt, self.vocab_size, "prompt token ids")
        if problem:
            raise ValueError(problem)
        if len(prompt) + max_tokens > self.target.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the target's context window "
                f"of {self.target.max_context} tokens"
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives, got {logprobs!r}")
        if seed is not None and not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator()
        generator.manual_seed(seed)
        stats = RequestStats([StageStats(s.name) for s in self.stages], prompt_tokens=len(prompt))
        request = Request(
            next(_seq_ids), list(prompt), params, max_tokens, generator, stats, None, ignore_eos=ignore_eos,
            started=self.clock(), seed=seed, coupled=coupled and not params.greedy, min_tokens=min_tokens if self.eos_token_ids else 0,
            penalties=penalties if penalties is not None and penalties.active else None, logprobs=logprobs,
            scope=scope,
        )
        if self.controller is not None:
            request.acceptance = self.controller.admit(request.regime)
        self.waiting.append(request)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[tuple[Request, list[int]]]:
        """Admit waiting requests while there is room, prefill a chunk of the new prompts, and run one round of the
        target for every prefilled request, all of them batched. Returns each running request with the tokens it
        committed this step (none while it is still prefilling); finished requests leave the running set."""
        wall, device = time.perf_counter(), device_seconds_on_this_thread()
        before = torch.get_num_threads()  # a setting of the calling thread (OpenMP's), restored for its caller
        if self.step_threads is not None:
            torch.set_num_threads(self.step_threads)
        try:
            return self._step()
        finally:
            if self.step_threads is not None:
                torch.set_num_threads(before)
            wall = time.perf_counter() - wall
            self.step_seconds += wall
            self.host_seconds += max(wall - (device_seconds_on_this_thread() - device), 0.0)

    def host_time(self) -> dict:
        """Wall seconds of the engine's steps and, of them, the host's (outside emulated passes and transfers on
        the step's thread, a Ray actor's emulated passes it waited for included: planning, Python, verification on
        the CPU, the data plane's real cost), unscaled."""
        return {"step_wall_seconds": round(self.step_seconds, 6), "host_wall_seconds": round(self.host_seconds, 6)}

    def _step(self) -> list[tuple[Request, list[int]]]:
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            # what the target holds of its prompt already (a retired sequence that began alike) is not prefilled
            request.prefilled = min(self.target.adopt(request.seq_id, request.prompt), len(request.prompt) - 1)
            self.running.append(request)
        record = self.passes.step_record = StepRecord() if self.controller is not None else None
        ready = [r for r in self.running if r.decoding]
        prefilled = self._prefill([r for r in self.running if not r.decoding], budget=self._prefill_budget(ready))
        ready = [r for r in self.running if r.decoding]
        committed: dict[Request, list[int]] = {request: [] for request in self.running}
        try:
            if ready:
                committed.update(self._decode(ready))
        finally:
            self.passes.step_record = None
        if record is not None:  # what the step did, for the controller: its one way in
            record.prefill_tokens = prefilled
            self.controller.observe(record)
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
        request.stats.seconds = self.clock() - request.started
        request.stats.verifier = self.verifier.chosen
        for stage, is_model in zip(self.stages, self.passes.is_model):
            if is_model:
                stage.release(request.seq_id)
            elif hasattr(stage, "learn") and request.finish_reason != "error":  # (its tokens are the target's)
                stage.learn(request.prompt + request.generated, request.scope)

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
        """Feed the next chunk of each prompt (first come, first served within ``budget``) to the target; returns the
        prompt tokens this step computes. The last prompt token is left to the first round, which needs its logits.

        A prompt whose rest fits in what is left of the budget gets no pass of its own: the request decodes this step,
        and the target's verifying pass computes the rest of its prompt with its first round (a model stage computes
        whatever of a context it has not cached). Only a prompt longer than that is fed, in chunks, in one batched
        forward before the step's rounds. A separate pass per arriving prompt costs its fixed part again: measured on
        the demo target, 16 decoding rows took 7.4 ms and a 35-token prompt alone 7.0 ms, both in one pass 12.2 ms;
        at 16 sampled clients whose requests finish at different steps, those passes made Cascade's steps 8% longer
        than the target alone's, whose requests (all of one length) finished together and shared one.

        Drafters are not prefilled: a drafter the controller bypasses never needs the prompt, and one that drafts
        catches up on its first forward pass (its cache is aligned by common prefix), at a fraction of the target's
        cost, which the controller's plans count (the step's ``StepRecord.prefill_tokens``)."""
        chunks: list[tuple[Request, int]] = []
        joined = 0  # prompt tokens the step's rounds compute
        for request in requests:
            if budget <= 0:
                break
            rest = len(request.prompt) - 1 - request.prefilled
            if rest <= budget:
                budget -= rest
                joined += rest
                request.prefilled += rest  # (computed by its first round's pass)
                continue
            chunks.append((request, request.prefilled + budget))
            budget = 0
        if not chunks:
            return joined
        started = self.clock()
        self.target.score([r.seq_id for r, _ in chunks], [r.prompt[:upto] for r, upto in chunks], [0] * len(chunks))
        tokens = sum(upto - r.prefilled for r, upto in chunks)
        self.passes.record(self.passes.target, [r for r, _ in chunks], tokens, self.clock() - started, fit=False)
        for request, upto in chunks:
            request.prefilled = upto
        return tokens + joined

    # ---- one round for every ready request ----------------------------------------------------------------

    def _decode(self, ready: list[Request]) -> dict[Request, list[int]]:
        """One round of the target for every request in ``ready``, all driven together; returns what each committed."""
        started = self.clock()
        step, drafts = self.planner.plans(ready)
        self.rounds.trees = step.trees
        rounds = self._start_rounds(step, drafts)
        ahead = {r: plan for r, (plan, _) in step.rounds.items()} if step.ahead else None
        results = self.rounds.drive(rounds, ahead, interrupt=self.interrupt_ahead, outcomes=self.ahead_outcomes)
        seconds = self.clock() - started
        committed = {request: self._commit(request, tokens) for request, tokens in results.items()}
        total = sum(len(tokens) for tokens in committed.values())
        self._tokens_per_request = 0.9 * self._tokens_per_request + 0.1 * total / len(ready)
        record = self.passes.step_record
        if record is not None:
            record.batch, record.committed, record.seconds = len(ready), total, seconds
        if self.observer is not None:
            self.observer.on_step(len(ready), sum(r.width for r in ready))
        return committed

    def _start_rounds(self, step: StepPlan, drafts: dict) -> dict[Request, Round]:
        """Each request's round under its plan, from the draft it has (``drafts``); the observer hears each distinct
        plan once, with how many rounds took it and how many of them changed plan."""
        rounds: dict[Request, Round] = {}
        observed: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}  # plan -> [rounds, changed]
        for request, (plan, _) in step.rounds.items():
            chain = [self.stages[i].name for i in plan.chain]
            changed = request.stats.record_plan(chain, plan.depths)
            if self.observer is not None:
                counts = observed.setdefault((plan.chain, plan.depths), [0, 0])
                counts[0] += 1
                counts[1] += changed
            remaining = request.max_tokens - len(request.generated)
            rounds[request] = self.rounds.top(plan, request, request.context, remaining, drafts.get(request))
        for (chain, depths), (count, changed) in observed.items():
            self.observer.on_plan([self.stages[i].name for i in chain], depths, count, changed)
        return rounds

    def _commit(self, request: Request, tokens: list[int]) -> list[int]:
        """Append what ``request``'s round gave (within its ``max_tokens``, up to an EOS) and mark it finished when
        it ends; returns the tokens committed."""
        if request.failure is not None:  # its rows were broken: nothing of this round is the target's
            request.finish_reason = "error"
            return []
        tokens = tokens[: request.max_tokens - len(request.generated)]
        if not request.ignore_eos:
            tokens, _ = self.passes.cut_at_eos(tokens)  # an accepted EOS may be followed by a bonus token
        request.generated.extend(tokens)
        if request.logprobs is not None:
            request.token_logprobs.extend(request.round_logprobs[: len(tokens)])
        request.stats.generated_tokens = len(request.generated)
        if not request.ignore_eos and tokens and tokens[-1] in self.eos_token_ids:
            request.finish_reason = "stop"
        elif len(request.generated) >= request.max_tokens:
            request.finish_reason = "length"
        return tokens
