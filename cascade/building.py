"""A cascade's parts from its configuration: models resolved (zoo families built on first use), stages loaded here
or launched as Ray actors, the target's tokenizer shown to be every model stage's, drafts fitted to the target's
vocabulary width. ``cascade.api.Cascade.from_config`` assembles them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cascade.config import ZOO_PREFIX, CascadeConfig, ConfigError, HFStageConfig, SuffixStageConfig
from cascade.emulation import EmulatedDevice, PassModel
from cascade.stages.base import LookupStage, ModelStage
from cascade.stages.hf import HFStage
from cascade.stages.loading import load_tokenizer, spread_over_gpus
from cascade.stages.ngram import NGramDrafter
from cascade.stages.suffix import SuffixDrafter


@dataclass(slots=True)
class Parts:
    """What a configuration builds: the stages (smallest first), the target's tokenizer, the model directories by
    stage name, and the Ray deployment holding the model stages' actors (None: they run in this process)."""

    stages: list[LookupStage | ModelStage]
    tokenizer: object
    paths: dict[str, str]
    deployment: object | None


def build(config: CascadeConfig) -> Parts:
    """Resolve, load or launch, and check every stage of ``config``; on failure nothing is left running."""
    paths = {sc.name: resolve_model(sc.model) for sc in config.stages if isinstance(sc, HFStageConfig)}
    deployment = _launch_ray(config, paths) if config.runtime.backend == "ray" else None
    try:
        stages, tokenizers = _build_stages(config, paths, deployment)
        tokenizer = _shared_tokenizer(tokenizers)
        _fit_vocabulary(stages)
    except BaseException:
        if deployment is not None:
            deployment.close()
        raise
    return Parts(stages, tokenizer, paths, deployment)


def resolve_model(model: str) -> str:
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


def _build_stages(config: CascadeConfig, paths: dict[str, str], deployment) -> tuple[list[LookupStage | ModelStage], list]:
    """The stages, smallest first, and ``(index, name, tokenizer)`` of each model stage: the deployment's actors,
    or models loaded here (``device: auto`` gives each its own GPU, the largest last)."""
    models = [sc for sc in config.stages if isinstance(sc, HFStageConfig)]
    auto = dict(zip((sc.name for sc in models), spread_over_gpus(len(models), torch.cuda.device_count())))
    stages: list[LookupStage | ModelStage] = []
    tokenizers = []
    for i, sc in enumerate(config.stages):
        if isinstance(sc, SuffixStageConfig):
            stages.append(SuffixDrafter(sc.name, key_length=sc.key_length, max_match=sc.max_match,
                                        max_tokens=sc.max_tokens, max_scopes=sc.max_scopes))
        elif not isinstance(sc, HFStageConfig):
            stages.append(NGramDrafter(sc.name, max_ngram=sc.max_ngram, min_ngram=sc.min_ngram, match=sc.match))
        elif deployment is not None:
            remote = deployment.stages[sc.name]
            roofline = config.emulation_spec(sc) or config.profile_spec(sc)
            remote.cost_prior = PassModel(roofline).prior if roofline is not None else None
            stages.append(remote)
            tokenizers.append((i, sc.name, load_tokenizer(sc.name, paths[sc.name])))
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


def _fit_vocabulary(stages: Sequence[LookupStage | ModelStage]) -> None:
    """Drafts are fitted to the target's (possibly padded) vocabulary width."""
    vocab = stages[-1].vocab_size
    for stage in stages[:-1]:
        if isinstance(stage, HFStage):
            stage.vocab_size = vocab
        elif hasattr(stage, "set_vocab_size"):
            stage.set_vocab_size(vocab)
