"""Sizes and training budgets of the offline model families.

Budgets are in optimizer steps, not seconds, so a build is deterministic for a given seed; they were sized so
that each preset builds within its time limit on a 2-core CPU (bf16 autocast where the CPU supports it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemberSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int  # ~2.7x hidden, the Llama ratio


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    vocab_size: int  # BPE merges stop here; small enough that the output projection does not dominate
    seq_len: int  # training window in tokens
    batch_size: int  # windows per step of the target's training (small batches, many steps: best in short runs)
    members: tuple[MemberSpec, ...]  # smallest first; the last one is the target
    target_steps: int  # next-token-prediction steps for the target
    distill_steps: int  # steps of the smaller members against the target's logits (all distilled together)
    target_lr: float
    distill_lr: float
    corpus_tokens: int  # train tokens prepared (windows are sampled from them); >> steps*batch*seq is not needed
    tokenizer_chars: int  # characters of train text the tokenizer learns its merges from
    eval_prompts: int  # held-out prompts for the agreement measurement
    eval_prompt_tokens: int
    eval_new_tokens: int  # greedy continuation of the target along which agreement is measured
    distill_batch_size: int = 16  # windows per distillation step (the loss uses every other position)
    ngram_depth: int = 4
    model_depth: int = 4
    distill_ce_weight: float = 0.1  # "a little cross-entropy" next to the KL to the target

    @property
    def target(self) -> MemberSpec:
        return self.members[-1]


PRESETS: dict[str, Preset] = {
    # For tests: three members that build in well under a minute.
    "tiny": Preset(
        name="tiny",
        vocab_size=512,
        seq_len=128,
        batch_size=16,
        members=(
            MemberSpec("small", 32, 1, 2, 88),
            MemberSpec("medium", 48, 2, 2, 128),
            MemberSpec("target", 96, 2, 4, 256),
        ),
        target_steps=250,
        distill_steps=150,
        target_lr=3e-3,
        distill_lr=3e-3,
        corpus_tokens=300_000,
        tokenizer_chars=600_000,
        eval_prompts=8,
        eval_prompt_tokens=32,
        eval_new_tokens=32,
    ),
    # The embedded default: the largest member has 16x the parameters of the smallest.
    "demo": Preset(
        name="demo",
        vocab_size=4096,
        seq_len=256,
        batch_size=8,
        members=(
            MemberSpec("small", 64, 2, 2, 176),
            MemberSpec("medium", 128, 3, 2, 344),
            MemberSpec("target", 256, 6, 4, 688),
        ),
        target_steps=420,
        distill_steps=260,
        target_lr=3e-3,
        distill_lr=4e-3,
        corpus_tokens=1_600_000,
        tokenizer_chars=3_000_000,
        eval_prompts=24,
        eval_prompt_tokens=64,
        eval_new_tokens=64,
    ),
    # For benchmarks: the target's forward pass dominates, as it does for real model families. Built in 31.5 minutes
    # on 2 cores (target ~1.6 s per 8-window step, distillation ~1.8 s per step).
    "bench": Preset(
        name="bench",
        vocab_size=8192,
        seq_len=256,
        batch_size=8,
        members=(
            MemberSpec("small", 96, 2, 2, 256),
            MemberSpec("medium", 256, 4, 4, 688),
            MemberSpec("target", 512, 8, 8, 1536),
        ),
        target_steps=700,
        distill_steps=400,
        target_lr=2e-3,
        distill_lr=3e-3,
        corpus_tokens=3_000_000,
        tokenizer_chars=6_000_000,
        eval_prompts=32,
        eval_prompt_tokens=64,
        eval_new_tokens=64,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown zoo preset {name!r}; choose one of {sorted(PRESETS)}") from None
