"""Rounds that stay on the stages' device: a stage's rows are warped, sampled and verified where the stage computed
them, and only token ids and counts cross to the host (``cascade.verify``).

On the CPU, tensors of a subclass stand in for a GPU's: reading one that holds distributions (floating point,
vocabulary wide) back to the host fails the test, and the verification op is checked to receive them. On a GPU
(marked, skipped here) the same rounds run on CUDA tensors through the native or Triton kernels."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import hf_stage, perturbed_copy, random_llama
from test_engine_greedy import EOS, NEW_TOKENS, build_prompts, target_greedy
from test_engine_sampling import PROMPT, VOCAB, TableModel, chi_square_p_value, exact_first_two, samples

from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.stages.draft import draft_tokens
from cascade.verify import Verifier

_HOST_READS = {"tolist", "numpy", "cpu", "item", "__float__", "__array__"}


class DeviceRows(torch.Tensor):
    """A CPU tensor standing in for one on a GPU: what is computed from it stays of this type, and reading
    vocabulary-wide floating-point rows back to the host raises."""

    vocab = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if t.is_floating_point() and t.dim() and t.shape[-1] == cls.vocab:
                raise AssertionError(f"{name}() read {tuple(t.shape)} rows back to the host")
        return super().__torch_function__(func, types, args, kwargs or {})


class OnDevice:
    """A stage whose outputs are 'device' tensors."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.vocab_size, self.max_context = inner.name, inner.vocab_size, inner.max_context

    @property
    def new_tokens(self):
        return self.inner.new_tokens

    def score(self, seq_ids, contexts, num_positions):
        return [rows.as_subclass(DeviceRows) for rows in self.inner.score(seq_ids, contexts, num_positions)]

    def argmax(self, seq_ids, contexts, num_positions):
        return [ids.as_subclass(DeviceRows) for ids in self.inner.argmax(seq_ids, contexts, num_positions)]

    def draft(self, seq_ids, contexts, depths, eos_token_ids, sampling):  # on this stage's "device" rows
        return draft_tokens(self, seq_ids, contexts, depths, eos_token_ids, sampling)

    def adopt(self, seq_id, prompt):
        return self.inner.adopt(seq_id, prompt)

    def release(self, seq_id):
        self.inner.release(seq_id)

    def num_cached_sequences(self):
        return self.inner.num_cached_sequences()

    def cached_tokens(self, seq_id):
        return self.inner.cached_tokens(seq_id)


class WatchedVerifier(Verifier):
    """Records the type of the tensors the verification op is given."""

    def __init__(self):
        super().__init__("reference")
        self.seen: list[type] = []

    def matching(self, draft_token_ids, cu_num_draft_tokens, target_tokens, max_depth):
        self.seen.append(type(target_tokens))
        return super().matching(draft_token_ids, cu_num_draft_tokens, target_tokens, max_depth)

    def sampling(self, draft_token_ids, cu, draft_probs, target_probs, uniforms, final_uniforms, max_depth):
        self.seen.append(type(target_probs))
        if draft_probs is not None:
            self.seen.append(type(draft_probs))
        return super().sampling(draft_token_ids, cu, draft_probs, target_probs, uniforms, final_uniforms, max_depth)


@pytest.fixture
def device_vocab(monkeypatch):
    def use(vocab: int) -> None:
        monkeypatch.setattr(DeviceRows, "vocab", vocab)

    return use


def test_sampling_rounds_stay_on_the_device_and_stay_exact(device_vocab):
    """Three table stages, rejection sampling and plain samples batched with greedy requests: no row is read
    back, verification gets the device rows (the target's and the drafts'), and the first two tokens still follow
    the target's distribution."""
    device_vocab(VOCAB)
    params = SamplingParams(temperature=0.9, top_k=8)
    target = TableModel("target", seed=0)
    medium = TableModel("medium", seed=0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.7
    bottom = TableModel("bottom", seed=1)
    verifier = WatchedVerifier()
    engine = CascadeEngine(
        [OnDevice(bottom), OnDevice(medium), OnDevice(target)], [3, 2], eos_token_id=None, verifier=verifier,
        max_running=48,
    )
    requests = []
    for seed in range(samples(3000)):
        requests.append(engine.add_request(PROMPT, params, 2, seed=seed))
        if seed % 16 == 0:
            engine.add_request([2, 5, 1], SamplingParams(), 3)  # greedy requests in the same steps
            engine.add_request([4, 4], params, 3, seed=seed, coupled=True)  # and seeded (coupled) ones
    while engine.has_work:
        engine.step()
    counts = Counter(tuple(r.generated[:2]) for r in requests)
    assert chi_square_p_value(counts, exact_first_two(target.logits_after, params)) > 1e-3
    assert DeviceRows in verifier.seen and all(t is DeviceRows for t in verifier.seen)


def test_greedy_and_min_tokens_rounds_stay_on_the_device(device_vocab):
    """Transformers-backed stages: greedy rounds (ids only) and rounds whose EOS is masked by min_tokens (rows)
    give the target's own greedy decode without reading a row back."""
    vocab = 48
    device_vocab(vocab)
    target = random_llama(vocab, 48, 2, seed=0, eos_token_id=EOS)
    stages = [OnDevice(hf_stage("close", perturbed_copy(target, 0.05, seed=1))), OnDevice(hf_stage("target", target))]
    prompts = build_prompts(vocab)[:8]
    engine = CascadeEngine(stages, [3], eos_token_id=EOS, verifier=WatchedVerifier(), max_running=8)
    requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts]
    masked = engine.add_request(prompts[1], SamplingParams(), NEW_TOKENS, min_tokens=NEW_TOKENS)
    while engine.has_work:
        engine.step()
    assert [r.generated for r in requests] == target_greedy(target, prompts)
    assert EOS not in masked.generated and len(masked.generated) == NEW_TOKENS
    assert engine.verifier.seen and all(t is DeviceRows for t in engine.verifier.seen)


# ---- on a GPU --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_rounds_on_a_gpu_match_the_target_and_use_the_kernels():
    vocab = 48
    target = random_llama(vocab, 48, 2, seed=0, eos_token_id=EOS)
    drafter = perturbed_copy(target, 0.05, seed=1).cuda()
    target = target.cuda()  # (Module.cpu() and .cuda() move the module itself: copy the drafter first)
    prompts = build_prompts(vocab)[:8]
    engine = CascadeEngine([hf_stage("close", drafter), hf_stage("target", target)], [3], eos_token_id=EOS)
    requests = [engine.add_request(p, SamplingParams(), NEW_TOKENS) for p in prompts]
    sampled = [engine.add_request(p, SamplingParams(temperature=0.8), NEW_TOKENS, seed=i) for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    expected = target_greedy(target.cpu(), prompts)
    assert [r.generated for r in requests] == expected
    assert all(len(r.generated) > 0 for r in sampled)
    assert engine.verifier.chosen in ("native", "triton")
