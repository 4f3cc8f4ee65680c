"""The Hugging Face stage keeps its KV cache consistent by longest common prefix, whatever it is asked."""

from __future__ import annotations

import random

import pytest
import torch

from cascade.stages.hf import HFStage, common_prefix_length
from tests.conftest import random_llama


@pytest.mark.parametrize("forward", ["transformers", "lean"])
def test_cache_stays_consistent_after_many_rejections(forward):
    model = random_llama(40, 32, 2, seed=0)
    stage = HFStage("m", model, forward=forward)
    rng = random.Random(0)
    context = [rng.randrange(40) for _ in range(5)]
    for step in range(120):
        # Mimic a cascade: extend by a draft, then keep a random prefix of it (a rejection) plus a new token.
        draft = [rng.randrange(40) for _ in range(rng.randint(0, 6))]
        asked = context + draft
        num_positions = rng.randint(1, len(draft) + 1)
        logits = stage.score([7], [asked], [num_positions])[0]  # [num_positions, vocab]
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([asked])).logits[0, -num_positions:]
        # transformers' RMSNorm computes in float32 even in a float64 model, the lean forward in float64
        tolerance = {"atol": 1e-9, "rtol": 1e-5} if forward == "transformers" else {"atol": 1e-5, "rtol": 1e-4}
        assert torch.allclose(logits, fresh, **tolerance), f"step {step}"
        context = asked[: len(context) + rng.randint(0, len(draft))] + [rng.randrange(40)]
        if step % 37 == 36:  # sometimes jump back far, as after a new request reuses the sequence id
            context = context[: rng.randint(1, len(context))]
    assert stage.cached_tokens(7) > 0
    stage.release(7)
    assert stage.cached_tokens(7) == 0


@pytest.mark.parametrize("forward", ["transformers", "lean"])
def test_sequences_are_cached_independently(forward):
    model = random_llama(30, 16, 1, seed=1)
    stage = HFStage("m", model, forward=forward)
    a, b = [1, 2, 3, 4], [5, 6, 7]
    la, lb = stage.score([0, 1], [a, b], [2, 1])
    with torch.inference_mode():
        assert torch.allclose(la, model(input_ids=torch.tensor([a])).logits[0, -2:], atol=1e-5, rtol=1e-4)
        assert torch.allclose(lb, model(input_ids=torch.tensor([b])).logits[0, -1:], atol=1e-5, rtol=1e-4)
    assert stage.cached_tokens(0) == 4 and stage.cached_tokens(1) == 3


def test_logits_are_fitted_to_the_target_vocabulary():
    model = random_llama(30, 16, 1, seed=2)
    wider = HFStage("m", model, vocab_size=34)
    out = wider.score([0], [[1, 2]], [1])[0]
    assert out.shape == (1, 34) and torch.isinf(out[0, 30:]).all()
    narrower = HFStage("m", model, vocab_size=25)
    assert narrower.score([0], [[1, 2]], [1])[0].shape == (1, 25)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([4, 5, 6, 7, 8], [4, 5, 6, 0, 8]) == 3


def test_device_auto_gives_each_model_stage_its_own_gpu_largest_last():
    from cascade.stages.loading import spread_over_gpus

    assert spread_over_gpus(3, 0) == ["cpu"] * 3
    assert spread_over_gpus(3, 1) == ["cuda"] * 3
    assert spread_over_gpus(3, 4) == ["cuda:1", "cuda:2", "cuda:3"]  # the target on the last GPU
    assert spread_over_gpus(3, 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert spread_over_gpus(4, 2) == ["cuda:0", "cuda:0", "cuda:0", "cuda:1"]  # small drafters share the first


def test_a_model_path_that_does_not_exist_is_reported_as_such(tmp_path):
    from cascade.stages.loading import load_model

    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model("target", str(tmp_path / "not-here"))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model("target", "./models/llama/8b")


@pytest.mark.parametrize("forward", ["transformers", "lean"])
def test_new_tokens_counts_the_positions_a_pass_computes(forward):
    """What the controller's cost model is fed: a first pass computes the whole context (a drafter catching up),
    a round its draft and bonus position, a rejection what differs from the cache."""
    stage = HFStage("m", random_llama(30, 16, 1, seed=2), forward=forward)
    context = list(range(1, 21))
    stage.score([0], [context], [1])
    assert stage.new_tokens == 20
    stage.score([0], [context + [5, 6, 7]], [4])  # a draft of three: three new positions and the last one again
    assert stage.new_tokens == 20 + 4
    stage.score([0], [context + [5, 9]], [1])  # the draft was cut after its first token: only 9 is new
    assert stage.new_tokens == 20 + 4 + 1
    stage.score([0], [context[:10]], [3])  # back to a prefix: its last three positions are recomputed
    assert stage.new_tokens == 20 + 4 + 1 + 3


def test_a_sequence_that_begins_like_a_released_one_takes_its_slot_and_scores_as_afresh():
    """``reuse_prefixes``: a context that begins with a released sequence's tokens computes only the positions after
    what they share, and its logits are a fresh stage's; one shorter than 16 tokens is not looked for."""
    model = random_llama(48, 48, 2, seed=0)
    stage = HFStage("target", model, forward="lean")
    context = [random.Random(1).randrange(6, 48) for _ in range(30)]
    stage.score([1], [context], [1])
    stage.release(1)
    assert stage.num_cached_sequences() == 0
    before = stage.new_tokens
    longer = context + [7, 8, 9, 10]
    got = stage.score([2], [longer], [1])[0]
    assert stage.new_tokens - before == 4 and stage.reused_tokens == 30
    fresh = HFStage("fresh", model, forward="lean").score([1], [longer], [1])[0]
    torch.testing.assert_close(got, fresh)
    stage.release(2)
    stage.score([3], [context[:12]], [1])
    assert stage.reused_tokens == 30


def test_a_pass_that_fails_part_way_leaves_no_slot_to_take_over_with_what_it_wrote():
    """A forward pass that dies part-way (here a stand-in for one that runs out of memory, a fault not caused for real:
    it writes over the positions it was given, then raises) leaves its sequences' slots holding only what they held
    before it; a later sequence that takes such a slot over recomputes the rest, and scores as afresh."""
    model = random_llama(48, 48, 2, seed=0)
    stage = HFStage("target", model, forward="lean")
    context = [random.Random(2).randrange(6, 48) for _ in range(30)]
    stage.score([1], [context], [1])
    stage.release(1)
    longer = context + [7, 8, 9, 10]
    real_forward = stage.lean.forward

    def dies_part_way(cache, slots, new_tokens, num_positions):
        for slot, tokens in zip(slots, new_tokens):
            start = cache.lengths[slot]
            cache.buffer[:, :, slot, :, start : start + len(tokens)] = 1e3
        raise MemoryError("a pass cut short")

    stage.lean.forward = dies_part_way
    with pytest.raises(MemoryError):
        stage.score([2], [longer], [1])
    stage.lean.forward = real_forward
    stage.release(2)
    got = stage.score([3], [longer], [1])[0]
    fresh = HFStage("fresh", model, forward="lean").score([1], [longer], [1])[0]
    torch.testing.assert_close(got, fresh)


def test_a_draft_tree_is_scored_in_one_pass_and_its_accepted_branch_stays_cached():
    """Every node's row equals the model's on the node's own path; after a branch is accepted, the next pass computes
    only the new token and still matches the model (the branch's keys and values were moved, not recomputed);
    batched with a chain sequence, in random trees."""
    from cascade.verify.tree import ROOT, Branch, flatten

    model = random_llama(40, 32, 2, seed=3)
    stage = HFStage("m", model, forward="lean")
    rng = random.Random(1)
    contexts = {7: [rng.randrange(40) for _ in range(9)], 8: [rng.randrange(40) for _ in range(6)]}

    def fresh(tokens):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([tokens])).logits[0, -1]

    for _ in range(12):
        spine = [rng.randrange(40) for _ in range(rng.randint(0, 4))]
        branches = [Branch(rng.randint(0, len(spine)), tuple(rng.randrange(40) for _ in range(rng.randint(1, 3))))
                    for _ in range(rng.randint(1, 3))]
        flat = flatten(spine, branches)
        chain = contexts[8] + [rng.randrange(40) for _ in range(2)]
        before = stage.new_tokens
        rows = stage.score_tree([7, 8], [contexts[7], chain], [1 + len(flat.tokens), 1], [flat, None])
        assert rows[0].shape[0] == 1 + len(flat.tokens) and rows[1].shape[0] == 1
        for node in [ROOT, *range(len(flat.tokens))]:
            path, n = [], node
            while n != ROOT:
                path.insert(0, flat.tokens[n])
                n = flat.parents[n]
            assert torch.allclose(rows[0][node + 1], fresh(contexts[7] + path), atol=1e-5, rtol=1e-4)
        assert torch.allclose(rows[1][0], fresh(chain), atol=1e-5, rtol=1e-4)
        # The context goes on along a random node's path (a branch's or the spine's), then one new token.
        node, path = rng.randrange(len(flat.tokens)), []
        while node != ROOT:
            path.insert(0, flat.tokens[node])
            node = flat.parents[node]
        contexts[7] = contexts[7] + path + [rng.randrange(40)]
        contexts[8] = chain
        before = stage.new_tokens
        row = stage.score([7], [contexts[7]], [1])[0][0]
        assert stage.new_tokens - before == 1  # only the new token: the path's keys and values were kept
        assert torch.allclose(row, fresh(contexts[7]), atol=1e-5, rtol=1e-4)


def test_a_tree_grown_pass_by_pass_computes_only_its_new_nodes():
    """A drafter growing its tree: each pass asks only the rows of the nodes it added (their parents anywhere among
    the nodes before, cached); each row equals the model's on the node's own path, the pass computes just those
    nodes, and the path the context then takes through the tree stays cached; batched with a chain sequence."""
    from cascade.verify.tree import ROOT, Flat

    model = random_llama(40, 32, 2, seed=5)
    stage = HFStage("m", model, forward="lean")
    rng = random.Random(2)

    def fresh(tokens):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([tokens])).logits[0, -1]

    def path_to(flat, node):
        path = []
        while node != ROOT:
            path.insert(0, flat.tokens[node])
            node = flat.parents[node]
        return path

    context, chain = [rng.randrange(40) for _ in range(7)], [rng.randrange(40) for _ in range(5)]
    stage.score([2], [chain], [1])
    for _ in range(4):
        stage.score([1], [context], [1])
        tokens, parents, depths = [], [], []
        for grow in range(4):
            added = rng.randint(1, 3)
            for _ in range(added):
                parent = rng.choice([ROOT, *range(len(tokens))])
                tokens.append(rng.randrange(40))
                parents.append(parent)
                depths.append(0 if parent == ROOT else depths[parent] + 1)
            flat = Flat(list(tokens), list(parents), list(depths))
            chain = chain + [rng.randrange(40)]
            before = stage.new_tokens
            rows = stage.score_tree([1, 2], [context, chain], [added, 1], [flat, None])
            assert rows[0].shape[0] == added
            # the new nodes and the chain's new token (the first tree pass feeds the context's last token again)
            assert stage.new_tokens - before == added + 1 + (grow == 0)
            for row, node in zip(rows[0], range(len(tokens) - added, len(tokens))):
                torch.testing.assert_close(row, fresh(context + path_to(flat, node)), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(rows[1][0], fresh(chain), atol=1e-5, rtol=1e-4)
        context = context + path_to(flat, rng.randrange(len(tokens))) + [rng.randrange(40)]
        before = stage.new_tokens
        torch.testing.assert_close(stage.score([1], [context], [1])[0][0], fresh(context), atol=1e-5, rtol=1e-4)
        assert stage.new_tokens - before == 1  # the path's keys and values were moved into place
