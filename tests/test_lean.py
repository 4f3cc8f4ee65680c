"""The lean, batched forward computes what transformers' forward computes, sequence by sequence, on its slot cache.

float32 models: transformers' RMSNorm computes in float32 whatever the model's dtype, the lean one in the
model's dtype, so the two agree to float32 rounding (a drafter's rows need not be bit-identical to anything).
"""

from __future__ import annotations

import pytest
import torch
from conftest import with_random_biases
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cascade.config import ConfigError, parse_config
from cascade.stages.hf import HFStage, choose_forward
from cascade.stages.lean import LeanDecoder, unsupported_reason

VOCAB = 64


def _llama(**overrides) -> LlamaForCausalLM:
    config = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.3,
    )
    return Qwen2ForCausalLM(config).eval()


MODELS = {
    "llama-gqa": _llama,
    "llama-mha-bias": lambda: _llama(num_key_value_heads=4, attention_bias=True),
    "llama3-rope": lambda: _llama(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "qwen2": _qwen2,
}


@torch.inference_mode()
def _transformers_logits(model, tokens: list[int], chunks: list[int]) -> list[torch.Tensor]:
    cache, out, start = DynamicCache(config=model.config), [], 0
    for size in chunks:
        ids = torch.tensor([tokens[start : start + size]])
        out.append(model(input_ids=ids, cache=cache, use_cache=True).logits[0])
        start += size
    return out


MODELS["llama-mha-bias"] = lambda: with_random_biases(_llama(num_key_value_heads=4, attention_bias=True))

# Per sequence, the new tokens of each batched call (0: not in that call): a prompt, single tokens, drafts, a
# long chunk that grows the cache past its first allocation, sequences joining late.
CHUNKS = [[37, 1, 1, 5, 300, 9, 1], [3, 0, 4, 1, 1, 260, 2], [0, 0, 12, 1, 7, 1, 1], [1, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("spacing", [1, -3], ids=["adjacent-slots", "scattered-slots-in-reverse"])
@pytest.mark.parametrize("name", list(MODELS))
def test_batched_lean_logits_equal_transformers(name, spacing, attention, request):
    """Ragged batches (different new-token counts and cache lengths per sequence, in adjacent cache slots or
    scattered ones in the reverse order) give each sequence the logits transformers computes for it alone, with
    decodes and drafts attended by the CPU kernel or by padded SDPA calls (the GPU's path)."""
    if attention == "kernel":
        request.getfixturevalue("cpu_kernel")
    model = MODELS[name]()
    generator = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, VOCAB, (400,), generator=generator).tolist() for _ in CHUNKS]
    expected = [_transformers_logits(model, t, [c for c in chunks if c]) for t, chunks in zip(tokens, CHUNKS)]
    lean = LeanDecoder(model, attention)
    cache = lean.new_cache()
    slots = [cache.allocate() for _ in range(abs(spacing) * len(CHUNKS))][::spacing]
    starts, calls = [0] * len(CHUNKS), [0] * len(CHUNKS)
    with torch.inference_mode():
        for step in range(len(CHUNKS[0])):
            members = [b for b in range(len(CHUNKS)) if CHUNKS[b][step]]
            sizes = [CHUNKS[b][step] for b in members]
            news = [tokens[b][starts[b] : starts[b] + n] for b, n in zip(members, sizes)]
            got = lean.forward(cache, [slots[b] for b in members], news, sizes).split(sizes)
            for b, rows in zip(members, got):
                torch.testing.assert_close(rows, expected[b][calls[b]], rtol=1e-4, atol=2e-5)
                starts[b] += CHUNKS[b][step]
                calls[b] += 1
    # Building the lean decoder re-points the model's weights at the fused tensors; the model is unchanged.
    again = _transformers_logits(model, tokens[0], [sum(CHUNKS[0])])[0][-1]
    torch.testing.assert_close(again, expected[0][-1][-1], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_cropped_slot_recomputes_like_a_fresh_one(attention, request):
    if attention == "kernel":
        request.getfixturevalue("cpu_kernel")
    model = _llama()
    lean = LeanDecoder(model, attention)
    tokens = list(range(3, 40))
    cache = lean.new_cache()
    a, b = cache.allocate(), cache.allocate()
    with torch.inference_mode():
        lean.forward(cache, [a, b], [tokens, tokens[:30]], [1, 1])
        cache.lengths[a] = 20  # a rejection: keep the first 20 positions, then feed different tokens
        branch = [7, 8, 9, 10]
        got = lean.forward(cache, [b, a], [[5], branch], [1, 4])[1:]
        fresh_cache = lean.new_cache()
        fresh = lean.forward(fresh_cache, [fresh_cache.allocate()], [tokens[:20] + branch], [4])
    torch.testing.assert_close(got, fresh, rtol=1e-4, atol=2e-5)


def test_slots_are_reused_and_grow():
    lean = LeanDecoder(_llama())
    cache = lean.new_cache()
    slots = [cache.allocate() for _ in range(9)]  # past the first allocation of slots
    assert sorted(slots) == list(range(9))
    cache.free(3)
    assert cache.allocate() == 3  # the lowest free slot: the running batch stays contiguous


def test_a_reserved_context_is_held_from_the_start_and_only_a_longer_one_grows_the_cache():
    """``batching.reserved_context``: the positions every slot holds from the start. Contexts up to it never grow
    the cache (no copy of every slot inside a step), a longer one does, and the logits are those of a cache that
    grew as it went."""
    grown, reserved = HFStage("grown", _llama(), forward="lean"), HFStage("reserved", _llama(), forward="lean",
                                                                          reserved_context=600)
    start = reserved.kv_cache_bytes()
    assert start > grown.kv_cache_bytes()
    context = [3 + i % 50 for i in range(550)]
    torch.testing.assert_close(reserved.score([0], [context], [4])[0], grown.score([0], [context], [4])[0])
    assert reserved.kv_cache_bytes() == start and grown.kv_cache_bytes() > 0
    reserved.score([0], [context + [7] * 100], [1])  # 650 positions, past the reservation
    assert reserved.kv_cache_bytes() == 2 * start


def test_stage_with_lean_forward_scores_like_transformers():
    model = _llama()
    reference = HFStage("ref", _llama())
    stage = HFStage("draft", model, forward="lean")
    contexts = [[3, 4, 5, 6, 7], [3, 4, 5, 9, 10, 11], [3, 4], [3, 4, 5, 9, 10, 11, 12, 13]]  # shared prefixes, rollbacks
    others = [[9, 9, 2], [9, 9, 2, 1, 1], [9], [9, 9, 2, 1, 1, 4, 4, 4, 4]]  # a second sequence in the same batches
    for context, other in zip(contexts, others):
        for n in (1, 2):
            got = stage.score([0, 5], [context, other], [n, 1])
            want = reference.score([0, 5], [context, other], [n, 1])
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5)
    drafts = stage.draft([1, 2], [contexts[0], others[1]], [6, 3], (), [None, None])
    assert drafts == reference.draft([1, 2], [contexts[0], others[1]], [6, 3], (), [None, None])
    assert [len(tokens) for tokens, _ in drafts] == [6, 3]


def test_unsupported_models_keep_transformers_forward():
    dynamic = _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "dynamic" in unsupported_reason(dynamic)
    assert choose_forward(dynamic, "auto") == "transformers"
    with pytest.raises(ValueError, match="dynamic"):
        choose_forward(dynamic, "lean")
    assert "MLP biases" in unsupported_reason(_llama(mlp_bias=True))
    assert choose_forward(_llama(), "auto") == "lean"
    assert choose_forward(_llama(), "transformers") == "transformers"


def test_config_forward_values():
    stages = [
        {"name": "draft", "type": "hf", "model": "a", "forward": "lean"},
        {"name": "target", "type": "hf", "model": "b", "forward": "lean"},  # the target may run it too
    ]
    assert parse_config({"stages": stages}).target.forward == "lean"
    with pytest.raises(ConfigError, match="forward"):
        parse_config({"stages": [{"name": "t", "type": "hf", "model": "b", "forward": "fast"}]})
