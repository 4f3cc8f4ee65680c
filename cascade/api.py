"""The public Python API: ``Cascade.from_config(...).generate(...)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cascade.building import build
from cascade.clock import Clock
from cascade.config import CascadeConfig, load_config, packaged_config_path
from cascade.controller import ControllerParams
from cascade.engine import CascadeEngine, Request
from cascade.engine.request import out_of_vocabulary
from cascade.eos import chat_turn_end, end_of_sequence_ids  # noqa: F401 - part of the API
from cascade.penalties import Penalties, TokenLogprob
from cascade.sampling import SamplingParams
from cascade.stages.base import LookupStage, ModelStage
from cascade.stages.hf import HFStage
from cascade.stats import RequestStats, RoundObserver
from cascade.text import TextTracker
from cascade.verify import Verifier


@dataclass(slots=True, eq=False)
class Generation:
    """A request of this cascade in flight, with its text so far (:meth:`Cascade.start`)."""

    request: Request
    tracker: TextTracker
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of them

    def cut_at_stop_token(self, tokens: list[int]) -> list[int] | None:
        """``tokens`` (this step's) up to and including the first stop token id; None when there is none."""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_token_ids), None)
        return None if end is None else tokens[: end + 1]

    @property
    def finished(self) -> bool:
        return self.request.finished


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only (an EOS that ended generation included)
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "error" (see ``error``)
    stats: RequestStats
    prompt_token_ids: list[int]
    error: str | None = None  # why it failed alone (finish_reason "error": its own rows were not finite)
    logprobs: list[TokenLogprob] | None = None  # per token of ``token_ids``, when asked for (``start(logprobs=)``)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.stats.seconds if self.stats.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            "tokens_per_second": round(self.tokens_per_second, 3),
            **({"error": self.error} if self.error else {}),
        }


class Cascade:
    """A cascade of stages with the target's tokenizer: text in, text out, exactly as the target would."""

    def __init__(
        self,
        stages: Sequence[LookupStage | ModelStage],
        depths: Sequence[int],
        tokenizer,
        *,
        name: str = "cascade",
        controller: ControllerParams | None = None,
        verifier: Verifier | None = None,
        shortcut: bool = False,
        max_running: int = 64,
        max_batched_tokens: int = 512,
        eos_token_ids: Sequence[int] | None = None,
        pipeline: bool = False,
        clock: Clock | None = None,
        siblings: Sequence[int] = (),
    ):
        """``eos_token_ids``: every id that ends a sequence (default: the tokenizer's EOS). ``pipeline``: draft the
        next round while the target verifies (``runtime.pipeline``). ``clock``: what every time the engine reports
        reads (default: the wall clock; emulated stages: wall seconds over their time scale). ``siblings``: per
        stage, the branch nodes per draft token of its trees for the target (a stage's ``siblings``)."""
        eos = eos_token_ids if eos_token_ids is not None else getattr(tokenizer, "eos_token_id", None)
        self.engine = CascadeEngine(
            stages, depths, eos_token_id=eos, controller=controller, verifier=verifier, shortcut=shortcut,
            max_running=max_running, max_batched_tokens=max_batched_tokens, pipeline=pipeline, clock=clock,
            siblings=siblings,
        )
        self._generations: dict[Request, Generation] = {}
        self.tokenizer = tokenizer
        self.served_model_name = name
        self.deployment = None  # a RayDeployment when the model stages run as Ray actors

    @classmethod
    def from_config(cls, config: str | Path | CascadeConfig | None = None, *, progress: bool = False) -> Cascade:
        """Build from a YAML path or a config object; ``None`` is the embedded demo (built on first use, which shows
        its progress). Quiet unless ``progress``: then transformers' weight loading shows its bars."""
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
        try:
            return cls._from_config(config)
        finally:
            (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()

    @classmethod
    def _from_config(cls, config: str | Path | CascadeConfig | None) -> Cascade:
        config = config if isinstance(config, CascadeConfig) else load_config(config or packaged_config_path("demo"))
        parts = build(config)
        deployment = parts.deployment
        try:
            cascade = cls(
                parts.stages, [sc.depth for sc in config.stages[:-1]], parts.tokenizer, name=config.served_model_name,
                controller=config.controller.params(), verifier=Verifier(config.verify.implementation),
                shortcut=bool(getattr(config.stages[0], "shortcut", False)),
                max_running=config.batching.max_running, max_batched_tokens=config.batching.max_batched_tokens,
                eos_token_ids=end_of_sequence_ids(parts.paths[config.target.name], parts.tokenizer),
                pipeline=config.runtime.pipeline, clock=Clock(config.time_scale),
                siblings=[getattr(sc, "siblings", 0) for sc in config.stages],
            )
        except BaseException:
            if deployment is not None:
                deployment.close()
            raise
        cascade.deployment = deployment
        if deployment is not None and deployment.shares_cores:
            # The driver's own work (verification, sampling) is light; with more than one thread its idle OpenMP
            # workers would wait actively, after every parallel op, on the cores the stage actors compute on.
            cascade.engine.step_threads = 1
        elif deployment is None and config.emulated:
            # Emulated stages' real compute stands in for devices of their own, so it should not wait on the host:
            # an OpenMP team as wide as the cores stalls at every parallel region whenever a host thread (a server's
            # event loop, its load's clients) takes one of them. One thread leaves the host the other cores: at 64
            # greedy clients over HTTP, the demo small model's passes took 8.7 ms against 12.6 ms with two threads
            # on 2 cores (docs/emulation.md; benchmarks/emulation.md has the measurements).
            cascade.engine.step_threads = 1
        return cascade

    # ---- what a server needs of the cascade --------------------------------------------------------------------

    @property
    def stage_names(self) -> list[str]:
        """The stages' names, smallest first; the last is the target."""
        return [stage.name for stage in self.engine.stages]

    @property
    def max_context(self) -> int:
        """The longest context (prompt and output, in tokens) the target accepts."""
        return self.engine.target.max_context

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary width: every token id is below it."""
        return self.engine.vocab_size

    @property
    def observer(self) -> RoundObserver | None:
        """What hears of every step, plan, draft and forward pass (the server's metrics); None: nothing."""
        return self.engine.observer

    @observer.setter
    def observer(self, observer: RoundObserver | None) -> None:
        self.engine.observer = observer

    @property
    def max_running(self) -> int:
        """The most generations decoding at once; more wait in the queue (:meth:`queue_depths`)."""
        return self.engine.max_running

    def set_batching(self, *, max_running: int | None = None, max_batched_tokens: int | None = None) -> None:
        """Change the batch limits (each at least 1): ``max_running`` generations at once, and a step's prefill
        budget of ``max_batched_tokens`` prompt tokens. A stage's KV slots were sized for the configured
        ``max_running``: more than that reallocates them as requests arrive."""
        for name, value in (("max_running", max_running), ("max_batched_tokens", max_batched_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"need {name} >= 1, got {value}")
        if max_running is not None:
            self.engine.max_running = max_running
        if max_batched_tokens is not None:
            self.engine.max_batched_tokens = max_batched_tokens

    def queue_depths(self) -> tuple[int, int]:
        """``(waiting, running)``: generations queued for a place in the batch, and those in it."""
        return len(self.engine.waiting), len(self.engine.running)

    def cache_gauges(self) -> dict[str, dict[str, Callable[[], int]]]:
        """Per model stage that reports them: ``cached_sequences`` (sequences it holds a cache for; a leak shows
        here), and, for a stage in this process, ``kv_cache_bytes`` and ``reused_tokens`` (context tokens new
        sequences found cached already); per drafter that learns across requests, ``kept_tokens`` (earlier requests'
        tokens it holds); each a function read when the gauge is scraped."""
        gauges: dict[str, dict[str, Callable[[], int]]] = {}
        for stage in self.engine.stages:
            if isinstance(stage, LookupStage):  # model-free: it caches nothing per sequence
                if hasattr(stage, "kept_tokens"):
                    gauges[stage.name] = {"kept_tokens": lambda stage=stage: stage.kept_tokens}
                continue
            own = gauges[stage.name] = {"cached_sequences": stage.num_cached_sequences}
            if isinstance(stage, HFStage):
                own["kv_cache_bytes"] = stage.kv_cache_bytes
                own["reused_tokens"] = lambda stage=stage: stage.reused_tokens
        return gauges

    @property
    def clock(self) -> Clock:
        """The engine's clock: wall seconds, or emulated seconds where stages are emulated."""
        return self.engine.clock

    def emulation_report(self) -> dict:
        """Per emulated stage: its device, model, passes, their real and emulated seconds and the share of each
        stretched pass the real compute took (a figure counts only under 25%); with the engine's host time (wall
        seconds its steps spent outside emulated passes) beside its steps' wall seconds. Empty when nothing is
        emulated."""
        stages = {}
        for stage in self.engine.stages:
            reported = getattr(stage, "emulation_report", None)  # model stages (local or Ray); not the n-gram drafter
            report = reported() if reported is not None else None
            if report is not None:
                stages[stage.name] = report
        if not stages:
            return {}
        return {"time_scale": self.clock.scale, "stages": stages, **self.engine.host_time()}

    def close(self) -> None:
        """Give back what the cascade holds outside this process (its Ray actors and placement group)."""
        if self.deployment is not None:
            self.deployment.close()

    def __enter__(self) -> Cascade:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation --------------------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return self.tokenizer.encode(prompt)  # with the tokenizer's own special tokens (a BOS, for Llama)
        return [int(t) for t in prompt]

    def start(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
        user: str | None = None,
    ) -> Generation:
        """Queue a request without running it; :meth:`step` advances every queued and running one together.
        ``ignore_eos``: generate ``max_tokens`` tokens whatever the target's end-of-sequence token says;
        ``min_tokens``: the target may not end before that many (its EOS is masked out until then). A sampled
        request with a ``seed`` is verified with shared noise, so the same seed and prompt give the same text under
        any plan, load or batch; without one it gets rejection sampling's higher acceptance
        (``CascadeEngine.add_request``). ``stop_token_ids``: generation ends after any of these tokens (kept in
        ``token_ids`` and the text), with ``finish_reason`` ``stop``. ``min_p`` filters as top-p does; the
        penalties and ``logprobs`` (each token's log-probability under the target, with that many alternatives) are
        the target's own (:mod:`cascade.penalties`): all of them keep the output exactly the target's. ``user``: the
        OpenAI end-user id; a drafter that learns across requests (``type: suffix``) drafts for a request only from
        earlier requests of the same user (or, without one, of everyone else without one)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        penalties = Penalties(repetition_penalty, presence_penalty, frequency_penalty)
        problem = out_of_vocabulary(stop_token_ids, self.engine.vocab_size, "stop_token_ids")
        if problem:
            raise ValueError(problem)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tracker = TextTracker(self.tokenizer, stops)
        request = self.engine.add_request(
            self.encode(prompt), params, max_tokens, seed, ignore_eos=ignore_eos, coupled=seed is not None,
            min_tokens=min_tokens, penalties=penalties, logprobs=logprobs, scope=user,
        )
        generation = Generation(request, tracker, frozenset(int(t) for t in stop_token_ids))
        self._generations[request] = generation
        return generation

    def step(self) -> list[tuple[Generation, str]]:
        """One engine step for every running generation (new ones join while there is room); returns each with the
        text that became final. A generation that is done is finished (its caches freed) and returned a last time.

        If the step fails (e.g. ``StageUnavailable``), every running and queued generation is finished as
        ``abort`` and the error propagates."""
        try:
            progressed = self.engine.step()
        except BaseException:
            for request in self.engine.abort_all():
                self._generations.pop(request, None)
            raise
        out = []
        for request, tokens in progressed:
            generation = self._generations[request]
            kept = generation.cut_at_stop_token(tokens) if generation.stop_token_ids and tokens else None
            if kept is not None:  # a stop token: nothing after it is the request's
                request.keep(len(request.generated) - len(tokens) + len(kept))
                tokens = kept
                self.engine.finish(request, "stop")
            delta = generation.tracker.add(tokens) if tokens else ""
            if generation.tracker.stopped:
                request.keep(generation.tracker.tokens_to_stop)
                self.engine.finish(request, "stop")
            if request.finished:
                delta += generation.tracker.flush()
                del self._generations[request]
            out.append((generation, delta))
        return out

    def abort(self, generation: Generation) -> None:
        """Stop a generation (a client went away): it leaves the batch and its caches are freed."""
        if not generation.finished:
            self.engine.finish(generation.request, "abort")
        self._generations.pop(generation.request, None)

    def result(self, generation: Generation) -> GenerationResult:
        request, tracker = generation.request, generation.tracker
        assert request.finished
        return GenerationResult(
            text=tracker.text,
            token_ids=list(request.generated),
            finish_reason=request.finish_reason,
            stats=request.stats,
            prompt_token_ids=list(request.prompt),
            error=request.failure,
            logprobs=list(request.token_logprobs) if request.logprobs is not None else None,
        )

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        """Yield text as it becomes final; ``generate`` with the same arguments gives the same text."""
        generation = self.start(prompt, **kwargs)
        try:
            while not generation.finished:
                for g, delta in self.step():
                    if g is generation and delta:
                        yield delta
        finally:
            self.abort(generation)  # a no-op once it is finished; frees it if the consumer stopped early

    def generate(
        self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], **kwargs
    ) -> GenerationResult | list[GenerationResult]:
        """Generate a completion. Keyword arguments: max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos.

        ``prompt`` is a string or a list of token ids; a list of those generates them all at once, batched (up to
        ``max_running`` at a time), and returns one result per prompt, in order (a ``seed`` applies to each)."""
        batch = not isinstance(prompt, str) and len(prompt) > 0 and not isinstance(prompt[0], int)
        generations = []
        try:
            for p in prompt if batch else [prompt]:
                generations.append(self.start(p, **kwargs))
            while not all(g.finished for g in generations):
                self.step()
        finally:
            for g in generations:
                self.abort(g)
        results = [self.result(g) for g in generations]
        return results if batch else results[0]
