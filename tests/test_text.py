"""Stop strings and incremental text, on the tiny family's tokenizer and on a real cascade."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from cascade import Cascade
from cascade.text import TextTracker


@pytest.fixture(scope="module")
def tokenizer(tiny_family):
    return AutoTokenizer.from_pretrained(str(tiny_family.member_path("target")))


def _feed(tracker, tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    emitted = ""
    for start in range(0, len(ids), chunk):
        emitted += tracker.add(ids[start : start + chunk])
        if tracker.stopped:
            break
    return emitted + tracker.flush()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_across_rounds_is_never_emitted(tokenizer, chunk):
    text = "def f(x):\n    return x\n\nclass A:\n    pass\n"
    tracker = TextTracker(tokenizer, ["\n\nclass"])
    out = _feed(tracker, tokenizer, text, chunk)
    assert out == "def f(x):\n    return x"
    assert tracker.stopped and tracker.text == out
    # The tokens kept are the fewest whose text reaches the stop string.
    kept = tracker.token_ids[: tracker.tokens_to_stop]
    assert "\n\nclass" in tokenizer.decode(kept)
    assert "\n\nclass" not in tokenizer.decode(kept[:-1])


def test_incremental_text_equals_full_decode_with_multibyte_characters(tokenizer):
    text = "naïve 日本語 — ✓ 🙂 done"
    tracker = TextTracker(tokenizer)
    pieces = []
    for token in tokenizer.encode(text):
        piece = tracker.add([token])
        assert "\ufffd" not in piece  # a partial character is held back, never emitted
        pieces.append(piece)
    pieces.append(tracker.flush())
    assert "".join(pieces) == text


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        TextTracker(tokenizer, [""])


def test_generate_with_stop_matches_stream(tiny_family):
    cascade = Cascade.from_config(tiny_family.config_path, progress=False)
    full = cascade.generate("def __init__(self", max_tokens=48)
    assert len(full.text) > 4
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]  # a string that appears mid-generation
    first = full.text.index(stop)
    stopped = cascade.generate("def __init__(self", max_tokens=48, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:first]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    streamed = "".join(cascade.stream("def __init__(self", max_tokens=48, stop=[stop]))
    assert streamed == stopped.text


def test_a_long_output_is_decoded_incrementally(tokenizer):
    """4,000 tokens one round at a time: the text equals a whole decode, and no round re-decodes the output so far
    (the cost per token does not grow with length); only the end of the request decodes it once."""
    import random

    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(4000)]

    class Counting:
        def __init__(self, inner):
            self.inner, self.decoded = inner, 0
            self.backend_tokenizer = inner.backend_tokenizer

        def decode(self, token_ids, **kwargs):
            self.decoded += len(token_ids)
            return self.inner.decode(token_ids, **kwargs)

    counting = Counting(tokenizer)
    tracker = TextTracker(counting)
    emitted = "".join(tracker.add([t]) for t in ids)
    assert counting.decoded == 0
    emitted += tracker.flush()
    assert emitted == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded == len(ids)
