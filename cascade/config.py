"""Cascade configuration: pydantic models loaded from YAML.

The YAML shape is a public interface (fields may be added; existing ones keep working)::

    served_model_name: cascade-demo
    stages:                  # smallest first; the last stage is the target
      - {name: ngram, type: ngram, max_ngram: 3, depth: 4}
      - {name: small, type: hf, model: ~/.cache/cascade/zoo/demo/small, depth: 4}
      - {name: target, type: hf, model: ~/.cache/cascade/zoo/demo/target}
    controller:
      mode: fixed
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cascade.controller import ControllerParams
from cascade.emulation import DEVICES, MODELS, EmulationSpec

# `zoo:<preset>/<member>` names a member of an offline family; it is resolved (and built if needed) at load.
ZOO_PREFIX = "zoo:"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the offending key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NGramStageConfig(_Strict):
    """Prompt-lookup drafter: proposes the continuation of the latest earlier occurrence of the context's tail."""

    name: str = Field(min_length=1)
    """Stage name, used in statistics, logs and metrics."""
    type: Literal["ngram"]
    max_ngram: int = Field(default=3, ge=1, le=64)
    """Longest tail (in tokens) that is looked up; shorter tails are tried down to ``min_ngram``."""
    min_ngram: int = Field(default=1, ge=1, le=64)
    """Shortest tail that counts as a match."""
    match: Literal["latest", "earliest", "consensus"] = "latest"
    """Which earlier occurrence of the tail to continue: the most recent, the first (as transformers does), or
    ``consensus``: token by token, what most occurrences continue with (see ``cascade.stages.ngram``)."""
    depth: int = Field(default=4, ge=1, le=64)
    """Tokens this stage drafts for the next stage per round."""
    shortcut: bool = False
    """Look up first each round: on a match, draft straight for the target (skipping the models between); on no
    match, let the smallest model draft. Only for a chain with at least one model between it and the target."""
    siblings: int = Field(default=0, ge=0, le=8)
    """Draft trees (``match: consensus``): when a found continuation goes straight to the target, up to this many
    other continuations — where the earlier occurrences disagreed — as branches the target scores in the same pass.
    0: a chain. As a model stage's ``siblings``: the adaptive controller keeps them only where they are observed to
    pay."""

    @model_validator(mode="after")
    def _ngram_range(self) -> NGramStageConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")
        return self


class SuffixStageConfig(_Strict):
    """A model-free drafter that learns across requests: the context's tail looked up in the request itself and in
    the prompts and outputs of earlier requests of the same scope (``cascade.stages.suffix``)."""

    name: str = Field(min_length=1)
    """Stage name, used in statistics, logs and metrics."""
    type: Literal["suffix"]
    key_length: int = Field(default=3, ge=1, le=64)
    """Tokens of the context's tail that must match an earlier occurrence."""
    max_match: int = Field(default=32, ge=1, le=1024)
    """How far back a match is followed to rank the occurrences (the longest shared history wins)."""
    max_tokens: int = Field(default=1 << 18, ge=64, le=1 << 26)
    """Tokens of earlier requests kept per scope (prompt and output each); the oldest requests go first. Memory: the
    tokens and their index, at most ~120 bytes a token (31.6 MB for a full scope of the default size)."""
    max_scopes: int = Field(default=64, ge=1, le=1 << 16)
    """Scopes kept (one per OpenAI ``user`` seen, plus the shared one); the least recently used goes first."""
    depth: int = Field(default=4, ge=1, le=64)
    """Tokens this stage drafts for the next stage per round."""
    shortcut: bool = False
    """As the n-gram drafter's: on a match draft straight for the target, else let the models draft."""
    siblings: int = Field(default=0, ge=0, le=8)
    """As the n-gram drafter's: up to this many other continuations of a found one as draft-tree branches."""

    @model_validator(mode="after")
    def _match_range(self) -> SuffixStageConfig:
        if self.key_length > self.max_match:
            raise ValueError(f"key_length ({self.key_length}) must not exceed max_match ({self.max_match})")
        return self


class DeviceModelConfig(_Strict):
    """A model on a device, as the roofline (``cascade.emulation``) models it: what an emulated stage stands for
    (``emulate``), or what a real stage is (``profile``, the controller's cost prior)."""

    device: str
    """An accelerator profile: mi300x, mi325x, h100, h200, a100-80gb or a100-40gb (``cascade plan --list``)."""
    model: str
    """A model shape the stage stands for, e.g. llama-3.1-70b (``cascade plan --list``)."""
    gpus: int = Field(default=1, ge=1, le=64)
    """Devices the model is split over (tensor parallelism)."""
    dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    """Weights and KV cache dtype of the emulated model."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in DEVICES:
            raise ValueError(f"unknown device {value!r}; known devices: {', '.join(sorted(DEVICES))}")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in MODELS:
            raise ValueError(f"unknown model {value!r}; known models: {', '.join(sorted(MODELS))}")
        return value


class EmulationConfig(_Strict):
    """Settings shared by every emulated stage."""

    time_scale: float = Field(default=8.0, gt=0, le=1000)
    """Emulated seconds are stretched by this factor so the real compute standing in for a pass stays a small share
    of it (a figure counts only under 25%: ``cascade bench`` reports the share); every time the engine, the server
    and the bench report is wall time divided by it. Host work is not stretched: it weighs 1/time_scale of its real
    share (the bench also reports its figures with host time at full weight)."""


class HFStageConfig(_Strict):
    """Any Hugging Face causal LM: a local directory, a hub id, or ``zoo:<preset>/<member>``."""

    name: str = Field(min_length=1)
    """Stage name, used in statistics, logs and metrics."""
    type: Literal["hf"]
    model: str = Field(min_length=1)
    """Model directory (``~`` is expanded), hub id, or ``zoo:<preset>/<member>`` for an offline family."""
    device: str = "auto"
    """``auto`` (the first GPU if any, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` (ROCm GPUs are ``cuda``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; ``auto`` is bfloat16 on a GPU and float32 on the CPU."""
    depth: int = Field(default=4, ge=1, le=64)
    """Tokens this stage drafts for the next stage per round (ignored for the target)."""
    siblings: int = Field(default=0, ge=0, le=8)
    """Draft trees: up to ``siblings`` × depth branch nodes beside this stage's draft for the stage above it. A
    bottom model grows them best-first by its own confidence: at each draft position the ``siblings`` tokens it found
    likeliest after the one it drew may fork, and a branch continues with its argmax as long as its path stays among
    the likeliest. A middle stage, whose draft is the tokens its own rounds verified, puts its ``siblings`` next
    likeliest tokens at each token's row beside it (those rows were computed: free). The stage above scores the
    tree in one pass and follows a branch where it rejects the draft's token (exact, greedy or sampled:
    ``cascade.verify.tree``); a middle stage's path through it goes up as its draft. 0: a chain. Needs the lean
    forward in the verifying stage (branches continue only where the drafter has it too: else they are one token)
    and in-process stages (``runtime.backend: local``); elsewhere drafts stay chains."""
    forward: Literal["auto", "transformers", "lean"] = "auto"
    """The forward pass: ``lean`` (Cascade's own: every step one batched forward pass over all requests, their KV
    caches in preallocated slots; Llama/Qwen2 architectures), ``transformers`` (the model's own forward, one
    request at a time), or ``auto`` (lean where it supports the model, else transformers)."""
    emulate: DeviceModelConfig | None = None
    """Emulate this stage on another device as another model (``{device: mi300x, model: llama-3.1-70b}``): tokens
    and acceptance stay this model's, the time of each pass is modelled (DESIGN.md, "Emulated accelerators")."""
    profile: DeviceModelConfig | None = None
    """What this (real) stage is, e.g. ``{device: mi300x, model: llama-3.1-70b}``: the adaptive controller starts
    from the roofline's predicted costs instead of a flat guess, and its measurements take over. An emulated stage
    has it already."""

    @model_validator(mode="after")
    def _one_roofline(self) -> HFStageConfig:
        if self.emulate is not None and self.profile is not None:
            raise ValueError("give emulate or profile, not both: an emulated stage's profile is what it emulates")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


StageConfig = Annotated[NGramStageConfig | SuffixStageConfig | HFStageConfig, Field(discriminator="type")]


_DEFAULTS = ControllerParams()  # the controller's defaults are its own, stated once


class ControllerConfig(_Strict):
    """How depths and the chain are chosen. The adaptive parameters are ignored in ``fixed`` mode."""

    mode: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: every stage drafts its configured ``depth`` each round. ``adaptive``: depths and the active
    chain are chosen every step from live acceptance statistics and measured forward costs."""
    max_depth: int = Field(default=_DEFAULTS.max_depth, ge=1, le=64)
    """The largest depth the adaptive controller considers for any stage."""
    warmup_rounds: int = Field(default=_DEFAULTS.warmup_rounds, ge=0)
    """Steps of the engine on the configured depths before the first adaptive decision."""
    hysteresis: float = Field(default=_DEFAULTS.hysteresis, ge=0.0, le=1.0)
    """A new plan must be predicted this much faster (a fraction) to replace the current one."""
    speculation_margin: float = Field(default=_DEFAULTS.speculation_margin, ge=0.0, le=1.0)
    """Drafting must be predicted this much faster (a fraction) than the target alone decoding plainly; where the
    gain is smaller, the target alone decodes (the model's error is larger than such a gain)."""
    explore_every: int = Field(default=_DEFAULTS.explore_every, ge=0)
    """Every this many steps, one request's round explores (a bypassed stage, an untried chain); 0 disables it."""
    window: float = Field(default=_DEFAULTS.window, gt=1.0)
    """Acceptance memory, in observed draft positions."""
    prior_weight: float = Field(default=_DEFAULTS.prior_weight, ge=0.0)
    """How many positions of a request's own statistics the global estimate is worth."""
    check_every: int = Field(default=_DEFAULTS.check_every, ge=0)
    """Drafting is checked against plain decoding, and (with the n-gram shortcut) steps that verify found
    continuations against steps that verify none, by the observed rates of the engine's steps at each load: where a
    mode's steps were slower it is turned off, and every this many steps a check runs it again (0: no checks)."""

    tree_cost_margin: float = Field(default=_DEFAULTS.tree_cost_margin, ge=0.0)
    """Where steps with draft trees and without are not yet observed at a load, trees run first on the stage pairs
    whose nodes add at most this share to the verifying stage's predicted pass (else chains); then the observed
    rates decide, and once a pair's branches are observed, the model keeps its trees only where they pay."""
    explore_budget: float = Field(default=_DEFAULTS.explore_budget, gt=0.0, le=1.0)
    """Explorations and checks together cost at most this fraction of the engine's time, as measured: each is
    charged its step's seconds less what the step's tokens would have taken at the rate of the other steps (1: no
    limit)."""

    def params(self) -> ControllerParams | None:
        if self.mode == "fixed":
            return None
        return dataclasses.replace(_DEFAULTS, **self.model_dump(exclude={"mode"}))


class RayStageResources(_Strict):
    """Where one model stage's actor may run and what it reserves there."""

    num_cpus: float | Literal["auto"] = "auto"
    """CPUs reserved for the actor. ``auto``: 1, or, on a Ray node Cascade starts itself with fewer CPUs than
    actors, an equal share of its CPUs."""
    num_threads: int | Literal["auto"] = "auto"
    """The actor's torch threads. ``auto``: ``num_cpus`` rounded down (at least 1); where ``num_cpus`` is an
    automatic share of a node Cascade started itself (the stages take turns on the same cores), all of the node's
    CPUs for the target's actor and one for each drafter's."""
    num_gpus: float | Literal["auto"] = "auto"
    """``auto``: 1 when the cluster has GPUs (Ray exposes AMD GPUs as ``GPU`` too), else 0."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, e.g. ``{node_b: 0.01}`` to pin the stage to the node started with that resource."""

    @field_validator("num_cpus")
    @classmethod
    def _cpus(cls, value):
        if value != "auto" and not value >= 0:
            raise ValueError(f"num_cpus must be auto or >= 0, got {value!r}")
        return value

    @field_validator("num_threads")
    @classmethod
    def _threads(cls, value):
        if value != "auto" and not value >= 1:
            raise ValueError(f"num_threads must be auto or >= 1, got {value!r}")
        return value

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, value):
        if value != "auto" and not 0 <= value <= 8:
            raise ValueError(f"num_gpus must be auto or between 0 and 8, got {value!r}")
        return value


class RayRuntimeConfig(_Strict):
    """Model stages as Ray actors, one placement-group bundle per actor."""

    address: str | None = None
    """``auto`` (the cluster this machine belongs to), ``ray://host:10001`` / ``host:6379``, or none to start a
    local Ray node (joining the one already started by ``ray.init`` in this process, if any)."""
    namespace: str = Field(default="cascade", min_length=1)
    """Ray namespace of the named stage actors (``cascade-<served_model_name>-<stage>``)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the placement group spreads the stage bundles over nodes."""
    default: RayStageResources = RayStageResources()
    """Resources of every stage not listed under ``stages``."""
    stages: dict[str, RayStageResources] = Field(default_factory=dict)
    """Per-stage resources, by stage name."""
    colocate: list[list[str]] = Field(default_factory=list)
    """Groups of model stages that share one actor (and its bundle: the first stage's resources)."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the placement group (resources busy elsewhere) before giving up; a placement the
    cluster can never satisfy fails at once."""
    load_timeout_s: float = Field(default=1800.0, gt=0)
    """How long an actor may take to load its models (also when it restarts): a 70B model takes minutes."""
    call_timeout_s: float = Field(default=60.0, gt=0)
    """How long one call to a stage actor (one batched forward or draft) may take: an actor that does not answer
    is restarted, and the requests in that step fail with HTTP 503 instead of hanging."""


class RuntimeConfig(_Strict):
    backend: Literal["local", "ray"] = "local"
    """``local``: every stage in this process. ``ray``: every model stage in a Ray actor."""
    ray: RayRuntimeConfig = RayRuntimeConfig()
    pipeline: bool = False
    """Draft the next round while the target verifies (the stages below the target on a second thread of the
    driver, beside the target's pass): worth it when the stages compute on separate devices (Ray actors, one GPU
    each); with every stage on one shared device they only slow each other. Output stays exact either way."""


class VerifyConfig(_Strict):
    implementation: Literal["auto", "reference", "triton", "native"] = "auto"
    """Verification op: ``auto`` (native HIP/CUDA kernels for GPU tensors when they build, else Triton on a GPU,
    else the PyTorch reference), or one of them explicitly. ``CASCADE_VERIFY_IMPL`` overrides this."""


class BatchingConfig(_Strict):
    """Continuous batching: how many requests run together and how many tokens a step may feed the target."""

    max_running: int = Field(default=64, ge=1, le=4096)
    """Requests decoding together; more wait in the queue. Each holds a KV-cache slot in every model stage, so KV
    memory is bounded by ``max_running`` times the longest context admitted (``cascade serve --max-running``)."""
    max_batched_tokens: int = Field(default=512, ge=1)
    """Per-step token budget: prompts are prefilled in chunks of what the decoding requests leave of it, one
    position each, scaled by the tokens a request commits per step (up to 4×: speculation commits several, and
    prompts keep their share of the work per committed token) and at least an eighth of it per step, so a long
    prompt never stalls the requests already decoding."""
    reserved_context: int = Field(default=0, ge=0)
    """Positions of KV cache every slot of every model stage holds from the start (0: as contexts need). A cache
    grows by doubling when a context longer than any before arrives, a copy of every slot inside that step: measured
    0.2–5.5 s on a CPU for the demo target's 64 slots at 1,024 positions, a stall of every running request. Reserved,
    the memory is taken once, when the engine starts (``max_running`` × this × the KV bytes per position), and only
    a longer context grows the cache."""
    reuse_prefixes: bool = True
    """A finished request's keys and values stay in its slot until the slot is needed, and a new request whose
    prompt begins with the same tokens (sent again, a shared system prompt, the next turn of a chat) takes it over:
    the target prefills only what differs, and a drafter catches up only on that. Uses only slots no running request
    holds: KV memory stays within ``max_running`` slots."""


class CascadeConfig(_Strict):
    served_model_name: str = Field(default="cascade", min_length=1)
    """The model id clients ask for (``/v1/models``)."""
    stages: list[StageConfig] = Field(min_length=1)
    """Smallest first; the last stage is the target and must be a model."""
    controller: ControllerConfig = ControllerConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    verify: VerifyConfig = VerifyConfig()
    batching: BatchingConfig = BatchingConfig()
    emulation: EmulationConfig = EmulationConfig()

    @model_validator(mode="after")
    def _chain(self) -> CascadeConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        if self.stages[-1].type != "hf":
            raise ValueError(f"the last stage is the target and must be a model (type: hf), got {self.stages[-1].type!r}")
        for i, stage in enumerate(self.stages[1:], start=1):
            if stage.type in ("ngram", "suffix"):
                raise ValueError(f"stages[{i}] ({stage.name!r}): a {stage.type} drafter can only be the first stage")
        model_stages = {s.name for s in self.stages if s.type == "hf"}
        ray = self.runtime.ray
        for name in ray.stages:
            if name not in model_stages:
                raise ValueError(f"runtime.ray.stages names {name!r}, which is not a model stage; model stages are {sorted(model_stages)}")
        grouped = [name for group in ray.colocate for name in group]
        for name in grouped:
            if name not in model_stages:
                raise ValueError(f"runtime.ray.colocate names {name!r}, which is not a model stage; model stages are {sorted(model_stages)}")
        if len(set(grouped)) != len(grouped) or any(not group for group in ray.colocate):
            raise ValueError(f"runtime.ray.colocate groups must be non-empty and disjoint, got {ray.colocate}")
        return self

    @property
    def target(self) -> HFStageConfig:
        return self.stages[-1]  # type: ignore[return-value]

    @property
    def emulated(self) -> bool:
        """Whether any stage is emulated (then the engine's clock reads emulated seconds)."""
        return any(isinstance(s, HFStageConfig) and s.emulate is not None for s in self.stages)

    @property
    def time_scale(self) -> float:
        """Wall seconds per emulated second: ``emulation.time_scale`` where a stage is emulated, else 1."""
        return self.emulation.time_scale if self.emulated else 1.0

    def emulation_spec(self, stage: HFStageConfig) -> EmulationSpec | None:
        """What ``stage`` stands for, with the config's time scale (None: it runs as it is)."""
        e = stage.emulate
        if e is None:
            return None
        return EmulationSpec(e.device, e.model, e.gpus, e.dtype, self.emulation.time_scale)

    @staticmethod
    def profile_spec(stage: HFStageConfig) -> EmulationSpec | None:
        """What a real ``stage`` is, for the controller's cost prior (None: no profile)."""
        p = stage.profile
        return None if p is None else EmulationSpec(p.device, p.model, p.gpus, p.dtype)


def _format_errors(error: ValidationError, source: str) -> str:
    lines = [f"invalid cascade config {source}:"]
    for e in error.errors():
        location = ".".join(str(part) for part in e["loc"] if part not in ("ngram", "suffix", "hf"))
        received = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"  {location or '<top level>'}: {e['msg']}{received}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "<dict>") -> CascadeConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid cascade config {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return CascadeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(path: str | Path) -> CascadeConfig:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    return parse_config(data, repr(str(path)))


def packaged_config_path(name: str = "demo") -> Path:
    """A shipped YAML config: ``configs/`` of a source checkout, or its copy inside an installed wheel."""
    here = Path(__file__).resolve().parent
    for directory in (here.parent / "configs", here / "configs"):
        if (directory / f"{name}.yaml").is_file():
            return directory / f"{name}.yaml"
    raise ConfigError(f"no shipped config named {name!r}")
