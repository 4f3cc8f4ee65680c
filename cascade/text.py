"""From committed tokens to text: incremental detokenization and stop strings.

Text is only released once it is final: a trailing partial UTF-8 character (decoded as U+FFFD) is held back
until its remaining bytes arrive, and so are the last ``len(longest stop) - 1`` characters, which might still
turn out to be the start of a stop string completed by the next round. Nothing past a stop string is emitted.

With a fast (``tokenizers``) tokenizer, new tokens are decoded by the library's ``DecodeStream`` (which keeps the
few tokens a partial character or a merged prefix needs), so a round costs the same at token 4,000 as at token 4;
other tokenizers re-decode the whole output each round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class TextTracker:
    tokenizer: object  # a transformers tokenizer (``decode``)
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded text of ``token_ids`` (cut at a stop string once one is found)
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: bool = False  # a stop string was found
    tokens_to_stop: int | None = None  # how many tokens it took to complete the stop string
    _backend: object = None  # the tokenizer's ``tokenizers.Tokenizer``, when it has one
    _stream: DecodeStream | None = None

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: Sequence[int]) -> str:
        """Take newly committed tokens; return the text that is now final (may be empty)."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.token_ids.extend(new_ids)
        if self._stream is None:
            self.text = self._decode(self.token_ids)
        else:
            self.text += "".join(piece for t in new_ids if (piece := self._stream.step(self._backend, t)))
        if self.stop:
            self._find_stop(before, len(new_ids))
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """The request is over: release whatever was held back (with a stream, also an unfinished character,
        decoded as U+FFFD as a whole decode would)."""
        if self._stream is not None and not self.stopped:
            whole = self._decode(self.token_ids)
            if whole.startswith(self.text):
                self.text = whole
        return self._release(final=True)

    def _find_stop(self, before: int, num_new: int) -> None:
        start = max(0, before - max(len(s) for s in self.stop) + 1)  # a stop string may straddle two rounds
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        self.text = self.text[:cut]
        self.stopped = True
        # The fewest tokens whose text reaches the stop string (only this round's tokens can be the last one).
        first = len(self.token_ids) - num_new
        for n in range(first + 1, len(self.token_ids) + 1):
            decoded = self._decode(self.token_ids[:n])
            if any(s in decoded for s in self.stop):
                self.tokens_to_stop = n
                break
        else:
            self.tokens_to_stop = len(self.token_ids)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.stop:
                end -= max(len(s) for s in self.stop) - 1
            while end > self.emitted and self.text[end - 1] == _REPLACEMENT:
                end -= 1
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
