"""The public Python API: ``Cascade.from_config(...).generate(...)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cascade.clock import Clock
from cascade.config import ZOO_PREFIX, CascadeConfig, ConfigError, HFStageConfig, load_config, packaged_config_path
from cascade.controller import ControllerParams
from cascade.emulation import EmulatedDevice, PassModel
from cascade.engine import CascadeEngine, Request
from cascade.eos import chat_turn_end, end_of_sequence_ids  # noqa: F401 - part of the API
from cascade.ops import Verifier
from cascade.penalties import Penalties, TokenLogprob
from cascade.sampling import SamplingParams
from cascade.stages.base import Drafter, Scorer
from cascade.stages.hf import HFStage, spread_over_gpus
from cascade.stages.ngram import NGramDrafter
from cascade.stats import RequestStats
from cascade.text import TextTracker


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


def _resolve_model(model: str) -> str:
    """``zoo:<preset>/<member>`` becomes the member's directory, building the family first if needed (with its
    progress shown even when loading is quiet: a first build takes minutes)."""
    if not model.startswith(ZOO_PREFIX):
        return model
    from cascade.zoo import build_family, default_family_dir, family_status

    preset, _, member = model[len(ZOO_PREFIX) :].partition("/")
    if not member:
        raise ConfigError(f"model {model!r}: expected zoo:<preset>/<member>, e.g. zoo:demo/target")
    if family_status(default_family_dir(preset)) != "complete":
        build_family(preset, progress=True)
    family_dir = default_family_dir(preset)
    if not (family_dir / member).is_dir():
        raise ConfigError(f"model {model!r}: the {preset!r} family has no member {member!r}")
    return str(family_dir / member)


def _load_tokenizer(name: str, path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"stage {name!r}: model {path!r} has no loadable tokenizer: {e}") from None


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


def _launch_ray(config: CascadeConfig, paths: dict[str, str]):
    """The model stages as Ray actors (``runtime.backend: ray``): a :class:`cascade.distributed.RayDeployment`."""
    try:
        from cascade.distributed import ModelFromPath, launch
    except ImportError as e:
        raise ConfigError(
            f"runtime.backend: ray needs Ray ({e}); install it with: pip install 'cascade-specdec[ray]'"
        ) from None
    batching = config.batching
    models = [
        (sc.name, ModelFromPath(sc.name, paths[sc.name], sc.device, sc.dtype, sc.forward, batching.max_running,
                                batching.reserved_context, batching.reuse_prefixes, config.emulation_spec(sc)))
        for sc in config.stages
        if isinstance(sc, HFStageConfig)
    ]
    return launch(models, config.runtime.ray, label=f"cascade-{config.served_model_name}")


def _build_stages(config: CascadeConfig, paths: dict[str, str], deployment) -> tuple[list[Drafter | Scorer], list]:
    """The stages, smallest first, and ``(index, name, tokenizer)`` of each model stage: the deployment's actors,
    or models loaded here (``device: auto`` gives each its own GPU, the largest last)."""
    models = [sc for sc in config.stages if isinstance(sc, HFStageConfig)]
    auto = dict(zip((sc.name for sc in models), spread_over_gpus(len(models), torch.cuda.device_count())))
    stages: list[Drafter | Scorer] = []
    tokenizers = []
    for i, sc in enumerate(config.stages):
        if not isinstance(sc, HFStageConfig):
            stages.append(NGramDrafter(sc.name, max_ngram=sc.max_ngram, min_ngram=sc.min_ngram, match=sc.match))
        elif deployment is not None:
            remote = deployment.stages[sc.name]
            roofline = config.emulation_spec(sc) or config.profile_spec(sc)
            remote.cost_prior = PassModel(roofline).prior if roofline is not None else None
            stages.append(remote)
            tokenizers.append((i, sc.name, _load_tokenizer(sc.name, paths[sc.name])))
        else:
            spec, profile = config.emulation_spec(sc), config.profile_spec(sc)
            stage = HFStage.from_pretrained(
                sc.name, paths[sc.name], device=auto[sc.name] if sc.device == "auto" else sc.device, dtype=sc.dtype,
                forward=sc.forward, max_sequences=config.batching.max_running,
                reserved_context=config.batching.reserved_context, reuse_prefixes=config.batching.reuse_prefixes,
                emulation=EmulatedDevice(spec) if spec is not None else None,
                profile=PassModel(profile) if profile is not None else None,
            )
            stages.append(stage)
            tokenizers.append((i, sc.name, stage.tokenizer))
    return stages, tokenizers


def _shared_tokenizer(tokenizers: list) -> object:
    """The target's tokenizer (the last model stage's), once every other model stage is shown to share it."""
    target_tokenizer = tokenizers[-1][2]
    for i, name, tok in tokenizers[:-1]:
        if not _same_tokenizer(tok, target_tokenizer):
            raise ConfigError(
                f"stages[{i}] ({name!r}) does not share the target's tokenizer "
                f"({len(tok)} vs {len(target_tokenizer)} tokens); every stage must use the target's vocabulary"
            )
    return target_tokenizer


def _fit_vocabulary(stages: Sequence[Drafter | Scorer]) -> None:
    """Drafts are fitted to the target's (possibly padded) vocabulary width."""
    vocab = stages[-1].vocab_size
    for stage in stages[:-1]:
        if isinstance(stage, HFStage):
            stage.vocab_size = vocab
        elif hasattr(stage, "set_vocab_size"):
            stage.set_vocab_size(vocab)


class Cascade:
    """A cascade of stages with the target's tokenizer: text in, text out, exactly as the target would."""

    def __init__(
        self,
        stages: Sequence[Drafter | Scorer],
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
    ):
        """``eos_token_ids``: every id that ends a sequence (default: the tokenizer's EOS). ``pipeline``: draft the
        next round while the target verifies (``runtime.pipeline``). ``clock``: what every time the engine reports
        reads (default: the wall clock; emulated stages: wall seconds over their time scale)."""
        eos = eos_token_ids if eos_token_ids is not None else getattr(tokenizer, "eos_token_id", None)
        self.engine = CascadeEngine(
            stages, depths, eos_token_id=eos, controller=controller, verifier=verifier, shortcut=shortcut,
            max_running=max_running, max_batched_tokens=max_batched_tokens, pipeline=pipeline, clock=clock,
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
        paths = {sc.name: _resolve_model(sc.model) for sc in config.stages if isinstance(sc, HFStageConfig)}
        deployment = _launch_ray(config, paths) if config.runtime.backend == "ray" else None
        try:
            stages, tokenizers = _build_stages(config, paths, deployment)
            target_tokenizer = _shared_tokenizer(tokenizers)
            _fit_vocabulary(stages)
            cascade = cls(
                stages, [sc.depth for sc in config.stages[:-1]], target_tokenizer, name=config.served_model_name,
                controller=config.controller.params(), verifier=Verifier(config.verify.implementation),
                shortcut=bool(getattr(config.stages[0], "shortcut", False)),
                max_running=config.batching.max_running, max_batched_tokens=config.batching.max_batched_tokens,
                eos_token_ids=end_of_sequence_ids(paths[config.target.name], target_tokenizer),
                pipeline=config.runtime.pipeline, clock=Clock(config.time_scale),
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
        return cascade

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
    ) -> Generation:
        """Queue a request without running it; :meth:`step` advances every queued and running one together.
        ``ignore_eos``: generate ``max_tokens`` tokens whatever the target's end-of-sequence token says;
        ``min_tokens``: the target may not end before that many (its EOS is masked out until then). A sampled
        request with a ``seed`` is verified with shared noise, so the same seed and prompt give the same text under
        any plan, load or batch; without one it gets rejection sampling's higher acceptance
        (``CascadeEngine.add_request``). ``stop_token_ids``: generation ends after any of these tokens (kept in
        ``token_ids`` and the text), with ``finish_reason`` ``stop``. ``min_p`` filters as top-p does; the
        penalties and ``logprobs`` (each token's log-probability under the target, with that many alternatives) are
        the target's own (:mod:`cascade.penalties`): all of them keep the output exactly the target's."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        penalties = Penalties(repetition_penalty, presence_penalty, frequency_penalty)
        bad = [t for t in stop_token_ids if not 0 <= int(t) < self.engine.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.engine.vocab_size}), got {bad[:5]}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tracker = TextTracker(self.tokenizer, stops)
        request = self.engine.add_request(
            self.encode(prompt), params, max_tokens, seed, ignore_eos=ignore_eos, coupled=seed is not None,
            min_tokens=min_tokens, penalties=penalties, logprobs=logprobs,
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
