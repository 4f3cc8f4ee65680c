"""The lean drafter forward computes what transformers' forward computes, on its own KV cache.

float32 models: transformers' RMSNorm computes in float32 whatever the model's dtype, the lean one in the
model's dtype, so the two agree to float32 rounding (a drafter's rows need not be bit-identical to anything).
"""

from __future__ import annotations

import pytest
import torch
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


@pytest.mark.parametrize("name", list(MODELS))
def test_lean_logits_equal_transformers(name):
    model = MODELS[name]()
    tokens = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    chunks = [37, 1, 1, 5, 300, 9, 1]  # a prompt, single tokens, drafts, and growth past the first allocation
    expected = _transformers_logits(model, tokens, chunks)
    lean = LeanDecoder(model)
    cache, start = lean.new_cache(), 0
    with torch.inference_mode():
        for size, want in zip(chunks, expected):
            got = lean.forward(torch.tensor(tokens[start : start + size]), cache, size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
            start += size
    # Building the lean decoder re-points the model's weights at the fused tensors; the model is unchanged.
    torch.testing.assert_close(_transformers_logits(model, tokens, chunks)[-1], expected[-1], rtol=0, atol=0)


def test_cropped_cache_recomputes_like_a_fresh_one():
    model = _llama()
    lean = LeanDecoder(model)
    tokens = list(range(3, 40))
    cache = lean.new_cache()
    with torch.inference_mode():
        lean.forward(torch.tensor(tokens), cache, 1)
        cache.crop(20)  # a rejection: keep the first 20 positions, then feed different tokens
        branch = [7, 8, 9, 10]
        got = lean.forward(torch.tensor(branch), cache, 4)
        fresh = lean.forward(torch.tensor(tokens[:20] + branch), lean.new_cache(), 4)
    torch.testing.assert_close(got, fresh, rtol=1e-4, atol=2e-5)


def test_stage_with_lean_forward_scores_like_transformers():
    model = _llama()
    reference = HFStage("ref", _llama())
    stage = HFStage("draft", model, forward="lean")
    contexts = [[3, 4, 5, 6, 7], [3, 4, 5, 9, 10, 11], [3, 4], [3, 4, 5, 9, 10, 11, 12, 13]]  # shared prefixes, rollbacks
    for context in contexts:
        for n in (1, 2):
            got, want = stage.score([0], [context], [n])[0], reference.score([0], [context], [n])[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    assert stage.greedy_draft(1, contexts[0], 6, None) == reference.greedy_draft(1, contexts[0], 6, None)


def test_unsupported_models_keep_transformers_forward():
    dynamic = _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "dynamic" in unsupported_reason(dynamic)
    assert choose_forward(dynamic, "auto", is_target=False) == "transformers"
    with pytest.raises(ValueError, match="dynamic"):
        choose_forward(dynamic, "lean", is_target=False)
    assert "MLP biases" in unsupported_reason(_llama(mlp_bias=True))
    assert choose_forward(_llama(), "auto", is_target=False) == "lean"
    assert choose_forward(_llama(), "auto", is_target=True) == "transformers"


def test_config_refuses_a_lean_target():
    stages = [
        {"name": "draft", "type": "hf", "model": "a", "forward": "lean"},
        {"name": "target", "type": "hf", "model": "b", "forward": "lean"},
    ]
    with pytest.raises(ConfigError, match="target"):
        parse_config({"stages": stages})
    with pytest.raises(ConfigError, match="forward"):
        parse_config({"stages": [{"name": "t", "type": "hf", "model": "b", "forward": "fast"}]})
