"""Small random models of the architectures users point Cascade at, built here with the project's own tokenizer
(the `tiny` family's; nothing is downloaded), saved as Hugging Face directories and loaded through the Python API:

- Llama-3 style: several end-of-sequence ids in ``generation_config``, llama3 RoPE scaling, grouped-query
  attention; one variant with non-zero attention biases;
- Qwen2 style: q/k/v biases (non-zero), tied input and output embeddings, and a vocabulary padded beyond the
  tokenizer's size (as Qwen2.5's 151,936 rows against 151,665 tokens).

Greedy output equals transformers' ``generate`` under the same generation config (stopping at the second EOS id
too), the lean forward's logits equal transformers' to float32 rounding, and sampling follows the target's
distribution."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from conftest import perturbed_copy, with_random_biases
from scipy.stats import chisquare
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cascade.api import Cascade
from cascade.sampling import SamplingParams, warp
from cascade.stages.hf import HFStage
from cascade.stages.lean import unsupported_reason

NEW_TOKENS = 20
PROMPTS = [
    "def parse(text):\n    return",
    "The quick brown fox",
    "import numpy as np\n",
    "for i in range(",
    "# A list of",
    "class Stack:\n    def push(self, item):",
]


def _llama3(vocab: int, *, hidden: int, seed: int, bias: bool):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3,
        attention_bias=bias,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    model = LlamaForCausalLM(config).eval()
    return with_random_biases(model, seed) if bias else model


def _qwen2(vocab: int, *, hidden: int, seed: int, bias: bool = True):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3,
        tie_word_embeddings=True,
    )
    return with_random_biases(Qwen2ForCausalLM(config).eval(), seed)


ARCHITECTURES = {
    "llama3": lambda vocab: _llama3(vocab, hidden=64, seed=0, bias=False),
    "llama3-attention-bias": lambda vocab: _llama3(vocab, hidden=64, seed=1, bias=True),
    "qwen2-padded-tied": lambda vocab: _qwen2(vocab + 61, hidden=64, seed=2),  # 61 rows beyond the tokenizer
}


def _plain_decodes(target, prompt_ids, eos_ids) -> list[list[int]]:
    out = []
    for ids in prompt_ids:
        tensor = torch.tensor([ids])
        generated = target.generate(
            input_ids=tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=eos_ids, pad_token_id=eos_ids[0],
        )
        out.append(generated[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_family):
    return AutoTokenizer.from_pretrained(tiny_family.path / "target")


def _save(model, tokenizer, path: Path, generation: GenerationConfig | None = None) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if generation is not None:
        generation.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def family(request, tokenizer, tmp_path_factory):
    """A target with three EOS ids in its generation_config (the tokenizer's, the chat template's end of turn as
    Qwen2.5 lists it, and a token its own greedy decodes produce in their middle, so it really ends some of them
    early), a close drafter of the same architecture, and a config chaining the n-gram drafter, the drafter and the
    target."""
    name = request.param
    target = ARCHITECTURES[name](len(tokenizer))
    assert unsupported_reason(target) is None  # the lean forward runs these
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    eos = tokenizer.eos_token_id
    base = [eos, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    plain = _plain_decodes(target, prompt_ids, base)
    counts = Counter(t for ref in plain for t in set(ref[2:-3]) if t not in base)
    second = max(counts, key=counts.get)
    eos_ids = [*base, second]
    expected = _plain_decodes(target, prompt_ids, eos_ids)
    assert sum(ref[-1] == second for ref in expected) >= 2  # the second id does end some decodes
    root = tmp_path_factory.mktemp(name)
    generation = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos, do_sample=False)
    paths = {
        "target": _save(target, tokenizer, root / "target", generation),
        "drafter": _save(perturbed_copy(target, 0.05, seed=7), tokenizer, root / "drafter", generation),
    }
    config = {
        "served_model_name": name,
        "stages": [
            {"name": "ngram", "type": "ngram", "max_ngram": 3, "depth": 4},
            {"name": "drafter", "type": "hf", "model": paths["drafter"], "depth": 4, "dtype": "float32"},
            {"name": "target", "type": "hf", "model": paths["target"], "dtype": "float32"},
        ],
    }
    config_path = root / "cascade.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return {"name": name, "target": target, "config": config_path, "prompt_ids": prompt_ids, "expected": expected,
            "eos_ids": eos_ids}


def test_greedy_equals_generate_and_stops_at_every_eos_id(family):
    engine = Cascade.from_config(family["config"])
    assert engine.engine.eos_token_ids == tuple(family["eos_ids"])  # read from generation_config
    results = engine.generate(family["prompt_ids"], max_tokens=NEW_TOKENS, temperature=0)
    assert [r.token_ids for r in results] == family["expected"]
    second = family["eos_ids"][-1]
    stopped = [r for r in results if r.token_ids[-1] == second]
    assert stopped and all(r.finish_reason == "stop" for r in stopped)


def test_lean_logits_equal_transformers(family):
    target = family["target"]
    stage = HFStage("target", target, forward="lean")
    contexts = [ids + ref[:5] for ids, ref in zip(family["prompt_ids"], family["expected"])]
    rows = stage.score(list(range(len(contexts))), contexts, [6] * len(contexts))
    for context, got in zip(contexts, rows):
        with torch.inference_mode():
            want = target(input_ids=torch.tensor([context])).logits[0, -6:]
        assert got.shape == want.shape  # the padded vocabulary's rows included
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ["qwen2-padded-tied"])
def test_sampling_follows_the_target(architecture, tokenizer, tmp_path):
    """The first two tokens of 2,400 sampled requests (batched together through n-gram → drafter → target) against
    the target's exact joint distribution under top-k 3, by chi-square; the same counts are far from the
    drafter's."""
    target = ARCHITECTURES[architecture](len(tokenizer))
    drafter = perturbed_copy(target, 0.4, seed=8)
    config = {
        "stages": [
            {"name": "ngram", "type": "ngram", "max_ngram": 3, "depth": 4},
            {"name": "drafter", "type": "hf", "model": _save(drafter, tokenizer, tmp_path / "d"), "depth": 3,
             "dtype": "float32"},
            {"name": "target", "type": "hf", "model": _save(target, tokenizer, tmp_path / "t"), "dtype": "float32"},
        ],
        "batching": {"max_running": 64},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    engine = Cascade.from_config(tmp_path / "c.yaml")
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = tokenizer.encode("def parse(text):\n    return")
    results = engine.generate([prompt] * 2400, max_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    counts = Counter(tuple(r.token_ids) for r in results)

    def joint(model) -> dict[tuple[int, int], float]:
        with torch.inference_mode():
            first = warp(model(input_ids=torch.tensor([prompt])).logits[0, -1:], params)[0].double()
            out = {}
            for a in first.nonzero().flatten().tolist():
                second = warp(model(input_ids=torch.tensor([prompt + [a]])).logits[0, -1:], params)[0].double()
                for b in second.nonzero().flatten().tolist():
                    out[(a, b)] = float(first[a] * second[b])
        return out

    def p_value(probabilities: dict[tuple[int, int], float]) -> float:
        if any(pair not in probabilities for pair in counts):
            return 0.0  # a pair of probability 0 was sampled
        cells = list(probabilities)
        total = sum(counts.values())
        expected = [probabilities[c] * total for c in cells]
        observed = [counts.get(c, 0) for c in cells]
        scale = sum(observed) / sum(expected)
        return float(chisquare(observed, [e * scale for e in expected]).pvalue)

    assert p_value(joint(target)) > 1e-3
    assert p_value(joint(drafter)) < 1e-6  # the test has power


def test_the_chat_templates_end_of_turn_ends_a_request(tokenizer, tmp_path):
    """The token a chat template writes after an assistant message ends a request even when generation_config does
    not list it: ChatML's <|im_end|>, Llama 3's <|eot_id|>; a template that ends a turn with plain text adds none."""
    from cascade.api import chat_turn_end, end_of_sequence_ids

    assert chat_turn_end(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_sequence_ids(str(tmp_path), tokenizer) == [tokenizer.eos_token_id, chat_turn_end(tokenizer)]
    llama3 = copy.deepcopy(tokenizer)
    llama3.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    llama3.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    assert chat_turn_end(llama3) == llama3.convert_tokens_to_ids("<|eot_id|>")
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert chat_turn_end(plain) is None
    plain.chat_template = None
    assert chat_turn_end(plain) is None
