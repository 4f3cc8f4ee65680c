"""The ``logprobs`` of a choice in OpenAI's two shapes: the completions API's parallel lists, and the chat API's
list of token records. Each token's log-probability is the target model's (``cascade.penalties.TokenLogprob``)."""

from __future__ import annotations

from collections.abc import Sequence

from cascade.penalties import TokenLogprob


class TokenText:
    """Each token id's own text (its decode alone), remembered: the alternatives repeat across positions."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` (``top_logprobs`` null when none were asked for);
    ``offset``: the characters of the choice's text before the first entry (a stream's earlier chunks)."""
    tokens = [text(e.token) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    asked = any(e.top for e in entries)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries] if asked else None,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict:
    def record(token: int, logprob: float) -> dict:
        piece = text(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**record(e.token, e.logprob), "top_logprobs": [record(t, lp) for t, lp in e.top]}
                        for e in entries]}
