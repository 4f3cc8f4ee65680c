"""The decoding methods a benchmark compares, each behind one ``generate`` call.

Names:
    target                  transformers ``generate`` with the target alone (the baseline)
    hf-assisted:<member>    transformers assisted generation with a smaller member as ``assistant_model``
    hf-prompt-lookup        transformers prompt-lookup decoding (``prompt_lookup_num_tokens``)
    cascade:<chain>@<depth> Cascade over ``chain`` (stage names joined by ``+``), every drafting stage at ``depth``
    cascade:<chain>@adaptive  Cascade over the whole family with the adaptive controller
    ...~shortcut             the same with the n-gram shortcut (a match drafts straight for the target)
    ...~tree                 the same with draft trees: each drafting stage puts up to TREE_SIBLINGS branch nodes
                             per draft token beside its draft (``siblings``; cascade.verify.tree)
    ...~pipelined            the same drafting the next round while the target verifies (``runtime.pipeline``)
    ray:cascade:...          the same with the model stages as Ray actors (a config whose backend is Ray)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cascade.api import Cascade
from cascade.clock import Clock
from cascade.controller import ControllerParams
from cascade.controller.model import candidate_chains
from cascade.stages.hf import HFStage
from cascade.stages.base import LookupStage, ModelStage

PROMPT_LOOKUP_TOKENS = 10  # the value transformers' documentation suggests
TREE_SIBLINGS = 2  # the ~tree methods' siblings per draft token


@dataclass(frozen=True, slots=True)
class Run:
    token_ids: list[int]
    seconds: float
    stats: dict | None  # Cascade's per-request statistics; None for transformers' methods


class HFMethod:
    """One of transformers' own ways to decode with the target."""

    def __init__(self, name: str, target: HFStage, *, assistant: HFStage | None = None, prompt_lookup: bool = False):
        self.name = name
        self.kind = "hf-assisted" if assistant else ("hf-prompt-lookup" if prompt_lookup else "target")
        self.target = target.model
        self.extra: dict = {}
        if assistant is not None:
            self.extra["assistant_model"] = assistant.model
        if prompt_lookup:
            self.extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> Run:
        device = next(self.target.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)
        sampling = {"do_sample": False} if temperature == 0 else {
            "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0,
        }
        torch.manual_seed(seed)
        started = time.perf_counter()
        out = self.target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, **sampling, **self.extra
        )
        seconds = time.perf_counter() - started
        return Run(out[0, len(prompt_ids) :].tolist(), seconds, None)


class CascadeMethod:
    def __init__(self, name: str, cascade: Cascade, chain: tuple[str, ...], depth: int | str):
        self.name, self.kind, self.cascade, self.chain, self.depth = name, "cascade", cascade, chain, depth

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> Run:
        clock = self.cascade.clock  # emulated seconds where the stages are emulated
        started = clock()
        result = self.cascade.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed)
        seconds = clock() - started
        return Run(result.token_ids, seconds, result.stats.to_dict())


Method = HFMethod | CascadeMethod


def chains(stage_names: list[str], has_ngram: bool) -> list[tuple[str, ...]]:
    """Every chain the controller may choose (``candidate_chains``), by name: the target alone first, then each subset
    of the smaller models by size, each without and with the n-gram drafter (which can only be at the bottom)."""
    first_model = 1 if has_ngram else 0

    def order(chain: tuple[int, ...]) -> tuple:
        models = tuple(i for i in chain[:-1] if i >= first_model)
        return len(models), models, len(chain) - 1 - len(models)

    return [tuple(stage_names[i] for i in c) for c in sorted(candidate_chains(len(stage_names)), key=order)]


def build_methods(
    stages: dict[str, HFStage | LookupStage],
    order: list[str],
    tokenizer,
    depths: list[int],
    controller: ControllerParams | None = None,
    clock: Clock | None = None,
) -> list[Method]:
    """All methods for a family: ``stages`` by name, ``order`` smallest first (the n-gram drafter first if any).
    ``clock``: the family's (emulated seconds where its stages are emulated: then the target alone is the engine's
    plain decoding on the emulated target, and transformers' methods, whose passes are not emulated, are left out)."""
    target = stages[order[-1]]
    has_ngram = not isinstance(stages[order[0]], ModelStage)  # a model-free drafter at the bottom
    chosen = chains(order, has_ngram)
    if clock is not None and clock.scale != 1:
        alone = CascadeMethod("target", Cascade([target], [], tokenizer, clock=clock), (order[-1],), 0)
        return [alone, *cascade_methods(stages, order, tokenizer, depths, controller, chosen[1:], clock=clock)]
    methods: list[Method] = [HFMethod("target", target)]
    for name in order[1 if has_ngram else 0 : -1]:
        methods.append(HFMethod(f"hf-assisted:{name}", target, assistant=stages[name]))
    methods.append(HFMethod("hf-prompt-lookup", target, prompt_lookup=True))
    return methods + cascade_methods(stages, order, tokenizer, depths, controller, chosen)


def cascade_methods(
    stages: dict, order: list[str], tokenizer, depths: list[int], controller: ControllerParams | None,
    chosen: list[tuple[str, ...]], prefix: str = "", pipeline: bool = False, clock: Clock | None = None,
) -> list[CascadeMethod]:
    """Cascades over ``stages`` (local or Ray stages alike): each chosen chain at each depth (with the n-gram
    shortcut where it applies), then the adaptive controller over the whole family. Names start with
    ``prefix``; ``pipeline``: pipelined cascades, named with ``~pipelined`` at the end."""
    suffix = "~pipelined" if pipeline else ""
    has_ngram = not isinstance(stages[order[0]], ModelStage)  # a model-free drafter at the bottom
    methods: list[CascadeMethod] = []
    trees = [TREE_SIBLINGS] * (len(order) - 1) + [0]  # every drafter's (the n-gram drafter's: its other continuations)
    for chain in chosen:
        for depth in depths if len(chain) > 1 else [0]:
            cascade = Cascade([stages[n] for n in chain], [depth] * (len(chain) - 1), tokenizer, pipeline=pipeline, clock=clock)
            name = prefix + "cascade:" + "+".join(chain) + (f"@{depth}" if depth else "")
            methods.append(CascadeMethod(name + suffix, cascade, chain, depth))
            if len(chain) > 1 and isinstance(stages[chain[0]], ModelStage):
                cascade = Cascade([stages[n] for n in chain], [depth] * (len(chain) - 1), tokenizer, pipeline=pipeline,
                                  clock=clock, siblings=[TREE_SIBLINGS] * (len(chain) - 1) + [0])
                methods.append(CascadeMethod(name + "~tree" + suffix, cascade, chain, depth))
            if has_ngram and chain[0] == order[0] and len(chain) > 2:
                cascade = Cascade([stages[n] for n in chain], [depth] * (len(chain) - 1), tokenizer, shortcut=True,
                                  pipeline=pipeline, clock=clock)
                methods.append(CascadeMethod(name + "~shortcut" + suffix, cascade, chain, depth))
    if len(order) > 1:
        # The adaptive controller over the whole family, starting from depth 4 everywhere.
        full = tuple(order)
        for shortcut in (False, True) if has_ngram and len(full) > 2 else (False,):
            for tree in (False, True) if shortcut or not has_ngram or len(full) <= 2 else (False,):
                cascade = Cascade([stages[n] for n in full], [4] * (len(full) - 1), tokenizer,
                                  controller=controller or ControllerParams(), shortcut=shortcut, pipeline=pipeline,
                                  siblings=trees if tree else (), clock=clock)
                name = prefix + "cascade:" + "+".join(full) + "@adaptive" + ("~shortcut" if shortcut else "") + \
                    ("~tree" if tree else "") + suffix
                methods.append(CascadeMethod(name, cascade, full, 0))
    return methods
