"""Training the family: next-token prediction for the target, distillation for the smaller members."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from cascade.zoo.presets import MemberSpec, Preset


def make_model(spec: MemberSpec, preset: Preset, *, eos_token_id: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=max(2048, 4 * preset.seq_len),
        tie_word_embeddings=True,  # keeps the small members small: the embedding is most of their weights
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@cache
def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast where the hardware computes bf16 natively (it halves training time on such CPUs)."""
    if device.type == "cuda":
        enabled = torch.cuda.is_bf16_supported()
    else:
        enabled = device.type == "cpu" and _cpu_has_bf16()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class WindowSampler:
    """Random training windows of ``seq_len`` tokens from one long token stream, reproducible from a seed."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"corpus has {stream.numel()} tokens; need more than one window of {seq_len}")
        self.stream = stream  # [num_tokens]
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len)
        return self.stream[starts[:, None] + offsets]  # [batch, seq_len]


def _lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _tail_mean(values: list[float]) -> float:
    """Mean over the last 10% of a training run (at least one value): the loss it ended at, less noisy."""
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_target(model: LlamaForCausalLM, sampler: WindowSampler, preset: Preset, *, progress: bool) -> float:
    """Next-token prediction; returns the mean loss over the last 10% of steps."""
    device = next(model.parameters()).device
    model.train()
    optimizer = _optimizer(model, preset.target_lr)
    losses: list[float] = []
    bar = tqdm(range(preset.target_steps), desc=f"train {preset.target.name}", unit="step", disable=not progress, mininterval=2.0)
    for step in bar:
        _set_lr(optimizer, _lr_at(step, preset.target_steps, preset.target_lr))
        batch = sampler.next().to(device)  # [batch, seq_len]
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return _tail_mean(losses)


def _logits_at(model: LlamaForCausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """Logits at every other position (1, 3, 5, ...) of ``inputs`` [batch, seq]: [batch * positions, vocab]."""
    hidden = model.model(input_ids=inputs).last_hidden_state[:, 1::2]  # [batch, positions, hidden]
    return model.lm_head(hidden).flatten(0, 1)


def distill(
    students: Sequence[LlamaForCausalLM],
    teacher: LlamaForCausalLM,
    sampler: WindowSampler,
    preset: Preset,
    *,
    progress: bool,
) -> list[float]:
    """Train every student on KL(teacher || student) plus a little cross-entropy, sharing one teacher pass.

    Returns each student's mean KL over the last 10% of steps.
    """
    device = next(teacher.parameters()).device
    teacher.eval()
    optimizers = [_optimizer(s, preset.distill_lr) for s in students]
    for s in students:
        s.train()
    kls: list[list[float]] = [[] for _ in students]
    names = "+".join(s_spec.name for s_spec in preset.members[: len(students)])
    bar = tqdm(range(preset.distill_steps), desc=f"distil {names}", unit="step", disable=not progress, mininterval=2.0)
    w = preset.distill_ce_weight
    for step in bar:
        batch = sampler.next().to(device)  # [batch, seq_len]
        # The loss is taken at every other position: the output projection and the softmax over the vocabulary
        # are most of a small model's cost, and neighbouring positions carry much the same signal.
        labels = batch[:, 2::2].flatten()  # [batch * positions]
        with torch.no_grad(), autocast(device):
            teacher_logits = _logits_at(teacher, batch[:, :-1]).float()  # [batch * positions, vocab]
        teacher_logp = F.log_softmax(teacher_logits, dim=-1)
        for i, (student, optimizer) in enumerate(zip(students, optimizers)):
            _set_lr(optimizer, _lr_at(step, preset.distill_steps, preset.distill_lr))
            with autocast(device):
                logits = _logits_at(student, batch[:, :-1])
            logp = F.log_softmax(logits.float(), dim=-1)  # [batch * positions, vocab]
            kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="batchmean")
            ce = F.nll_loss(logp, labels)
            loss = (1 - w) * kl + w * ce
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            kls[i].append(kl.item())
        bar.set_postfix({spec.name: f"{k[-1]:.3f}" for spec, k in zip(preset.members, kls)})
    for s in students:
        s.eval()
    return [_tail_mean(k) for k in kls]
