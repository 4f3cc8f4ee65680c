"""How good a family is: held-out loss per member, and how often the members agree with each other."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


@torch.inference_mode()
def held_out_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats per token) over ``windows`` [num_windows, seq_len]."""
    total, count = 0.0, 0
    for chunk in windows.split(8):
        logits = model(input_ids=chunk).logits[:, :-1].float()  # [chunk, seq_len - 1, vocab]
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


@torch.inference_mode()
def greedy_continuations(target: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's greedy continuation of each prompt: [num_prompts, prompt_len + new_tokens]."""
    return target.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # keep every row the same length: agreement is measured per position
        do_sample=False,
    )


@torch.inference_mode()
def argmax_along(model: LlamaForCausalLM, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Each model's argmax at every continuation position: [num_prompts, new_tokens]."""
    logits = model(input_ids=sequences).logits  # [num_prompts, total_len, vocab]
    return logits[:, prompt_len - 1 : -1].argmax(dim=-1)


def agreement_rates(
    models: Sequence[LlamaForCausalLM], names: Sequence[str], prompts: torch.Tensor, new_tokens: int
) -> dict[str, float]:
    """Greedy agreement for each adjacent pair and for each member against the largest (the last).

    Agreement of A and B is the fraction of positions along the target's greedy continuation where A's and B's
    argmax tokens are equal — the acceptance rate a greedy cascade would see drafting B with A at depth 1.
    """
    sequences = greedy_continuations(models[-1], prompts, new_tokens)
    argmaxes = [argmax_along(m, sequences, prompts.shape[1]) for m in models]
    pairs = {(i, i + 1) for i in range(len(models) - 1)} | {(i, len(models) - 1) for i in range(len(models) - 1)}
    return {
        f"{names[i]}->{names[j]}": (argmaxes[i] == argmaxes[j]).float().mean().item() for i, j in sorted(pairs)
    }
