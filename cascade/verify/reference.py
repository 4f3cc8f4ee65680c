"""The verification rule: pure functions over batched, ragged tensors.

This is the PyTorch reference (and the CPU path) of the verification op; GPU kernels must agree with it exactly.
Layout, as in vLLM's rejection sampler — the drafts of all requests are flattened:

    draft_token_ids      [num_tokens]            the drafts, request after request
    cu_num_draft_tokens  [batch + 1]             request b's drafts are draft_token_ids[cu[b]:cu[b+1]]
    draft_probs          [num_tokens, vocab]     q rows (None: greedy, or one-hot drafts from the n-gram drafter)
    target_probs         [num_tokens + batch, vocab]  p rows: request b owns rows cu[b]+b .. cu[b+1]+b, the last
                                                 of them being the bonus position
    uniforms             [num_tokens]            U[0, 1) draws for the accept tests
    final_uniforms       [batch]                 a U[0, 1) draw per request for its one recovered-or-bonus token

Outputs: ``output_token_ids`` [batch, max_depth + 1] (accepted drafts, then the recovered or bonus token, then
``PLACEHOLDER_TOKEN_ID``) and ``num_accepted`` [batch].
"""

from __future__ import annotations

import torch

from cascade.sampling import sample_rows

PLACEHOLDER_TOKEN_ID = -1


def _ragged_index(cu_num_draft_tokens: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors that lay the flat drafts out as [batch, max_depth].

    Returns (draft_rows [batch, max_depth], target_rows [batch, max_depth + 1], valid [batch, max_depth]).
    Out-of-range rows are clamped to 0 and must be masked with ``valid``.
    """
    batch = cu_num_draft_tokens.numel() - 1
    starts = cu_num_draft_tokens[:-1, None]  # [batch, 1]
    lengths = cu_num_draft_tokens[1:, None] - starts  # [batch, 1]
    positions = torch.arange(max_depth + 1, device=cu_num_draft_tokens.device)[None]  # [1, max_depth + 1]
    valid = positions[:, :max_depth] < lengths  # [batch, max_depth]
    draft_rows = torch.where(valid, starts + positions[:, :max_depth], 0)
    request = torch.arange(batch, device=cu_num_draft_tokens.device)[:, None]  # [batch, 1]
    target_rows = torch.where(positions <= lengths, starts + request + positions, 0)
    return draft_rows, target_rows, valid


def _accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row. accepted: [batch, max_depth] bool -> [batch]"""
    return accepted.to(torch.int32).cumprod(dim=1).sum(dim=1)


def matching(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1]
    target_tokens: torch.Tensor,  # [num_tokens + batch]: the target's own token at each row (its argmax when
    # greedy, its coupled sample when seeded)
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification by matching: accept each draft while it equals the target's own token; the first mismatch
    becomes the target's token (recovered), and a fully accepted draft earns the target's next token (bonus)."""
    draft_rows, target_rows, valid = _ragged_index(cu_num_draft_tokens, max_depth)
    drafts = draft_token_ids[draft_rows] if draft_token_ids.numel() else draft_rows  # [batch, max_depth]
    laid_out = target_tokens[target_rows]  # [batch, max_depth + 1]
    num_accepted = _accepted_prefix((drafts == laid_out[:, :max_depth]) & valid)  # [batch]
    positions = torch.arange(max_depth + 1, device=draft_token_ids.device)[None]
    # Accepted drafts equal the target's tokens, so the output is the target's tokens up to and including the
    # first mismatch (or the bonus position).
    output = torch.where(positions <= num_accepted[:, None], laid_out, PLACEHOLDER_TOKEN_ID)
    return output, num_accepted


def sampling(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab], or None for one-hot drafts
    target_probs: torch.Tensor,  # [num_tokens + batch, vocab]
    uniforms: torch.Tensor,  # [num_tokens]
    final_uniforms: torch.Tensor,  # [batch]
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023), batched and ragged.

    Accept draft y_j with probability min(1, p_j(y_j) / q_j(y_j)), i.e. when u_j * q_j(y_j) < p_j(y_j); a draft
    the drafter gave probability 0 is rejected. At the first rejection the recovered token is drawn from
    normalize(max(0, p_j - q_j)) (from p_j itself if rounding left the residual no positive entry); after a fully
    accepted draft the bonus token is drawn from p_{k+1}. Either draw inverts the row's cumulative weights with the
    request's final uniform (:func:`cascade.sampling.sample_rows`), which needs no normalisation.
    """
    batch = cu_num_draft_tokens.numel() - 1
    draft_rows, target_rows, valid = _ragged_index(cu_num_draft_tokens, max_depth)
    num_tokens = draft_token_ids.numel()
    if num_tokens:
        request_of_token = torch.repeat_interleave(
            torch.arange(batch, device=draft_token_ids.device), cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
        )  # [num_tokens]
        target_row_of_token = torch.arange(num_tokens, device=draft_token_ids.device) + request_of_token
        p = target_probs[target_row_of_token, draft_token_ids]  # [num_tokens]
        q = draft_probs[torch.arange(num_tokens, device=draft_token_ids.device), draft_token_ids] if draft_probs is not None else torch.ones_like(p)
        token_accepted = (uniforms * q < p) & (q > 0)  # [num_tokens]
        drafts = draft_token_ids[draft_rows]  # [batch, max_depth]
        accepted = token_accepted[draft_rows] & valid
    else:
        drafts = draft_rows
        accepted = valid
    num_accepted = _accepted_prefix(accepted)  # [batch]

    # The one position per request where a token is drawn: the first rejection, or the bonus position.
    final_rows = target_rows.gather(1, num_accepted[:, None].long()).squeeze(1)  # [batch]
    final_p = target_probs[final_rows]  # [batch, vocab]
    lengths = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]  # [batch]
    rejected = num_accepted < lengths  # [batch]
    if num_tokens:
        rejected_token = (cu_num_draft_tokens[:-1] + num_accepted).clamp(max=num_tokens - 1)  # [batch]
        if draft_probs is not None:
            residual = final_p - draft_probs[rejected_token]  # [batch, vocab]
            residual.clamp_(min=0)
        else:  # max(p - one_hot(y), 0): p without the drafted token (p(y) - 1 <= 0)
            residual = final_p.scatter(1, draft_token_ids[rejected_token][:, None], 0.0)
        # If rounding left no residual mass, fall back to p: it is what the residual approximates then.
        has_mass = residual.amax(dim=1) > 0  # [batch]
        final_dist = torch.where((rejected & has_mass)[:, None], residual, final_p)
    else:
        final_dist = final_p
    final_tokens = sample_rows(final_dist, final_uniforms)  # [batch]

    positions = torch.arange(max_depth + 1, device=draft_token_ids.device)[None]  # [1, max_depth + 1]
    padded_drafts = torch.nn.functional.pad(drafts, (0, 1), value=PLACEHOLDER_TOKEN_ID)  # [batch, max_depth + 1]
    output = torch.where(positions < num_accepted[:, None], padded_drafts, PLACEHOLDER_TOKEN_ID)
    output = torch.where(positions == num_accepted[:, None], final_tokens[:, None], output)
    return output, num_accepted
