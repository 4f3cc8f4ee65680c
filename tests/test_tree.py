"""Draft trees (cascade.verify.tree): greedy follows the verifier's argmax down the tree; sampling over siblings keeps
the committed tokens distributed exactly as the verifier's, checked against exact enumeration."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare

from cascade.verify.tree import (
    ROOT,
    Branch,
    flatten,
    spine_length,
    tree_draws,
    verify_tree_matching,
    verify_tree_sampling,
)
from cascade.stages.draft import draft_tokens, draft_tree
from tests.test_engine_sampling import TableModel, samples

VOCAB = 4


def _dist(prefix: tuple[int, ...], salt: int, sharp: float) -> torch.Tensor:
    """A fixed distribution over VOCAB tokens for each prefix (a stand-in model): [VOCAB]."""
    g = torch.Generator().manual_seed(hash((salt, *prefix)) % (2**31))
    return torch.softmax(sharp * torch.randn(VOCAB, generator=g, dtype=torch.float64), dim=0)


def target(prefix):
    return _dist(prefix, 1, 1.5)


def drafter(prefix):
    return (0.5 * _dist(prefix, 2, 1.5) + 0.5 * target(prefix)).double()


def test_flatten_lays_the_spine_out_first_then_each_branch_from_its_fork():
    flat = flatten([5, 6, 7], [Branch(1, (8, 9)), Branch(0, (4,)), Branch(3, (2,))])
    assert flat.tokens == [5, 6, 7, 8, 9, 4, 2]
    assert flat.parents == [ROOT, 0, 1, 0, 3, ROOT, 2]
    assert flat.depths == [0, 1, 2, 1, 2, 0, 3]
    assert spine_length(flat) == 3


def test_matching_follows_a_branch_where_the_spine_is_rejected():
    flat = flatten([5, 6, 7], [Branch(1, (8, 9))])
    # rows: root, after 5, after 6, after 7, after 8, after 9
    committed, path = verify_tree_matching(flat, [5, 8, 0, 0, 9, 3])
    assert committed == [5, 8, 9, 3] and path == [0, 3, 4]
    committed, path = verify_tree_matching(flat, [5, 6, 7, 1, 9, 3])  # the spine whole, then the bonus
    assert committed == [5, 6, 7, 1] and path == [0, 1, 2]
    committed, path = verify_tree_matching(flat, [2, 6, 7, 1, 9, 3])  # nothing accepted: the verifier's token
    assert committed == [2] and path == []


def _tree_round(prefix, generator, depth=2):
    """One round: a spine of ``depth`` tokens sampled from the drafter, beside each spine token the drafter's likeliest
    other token (a deterministic candidate), and a deterministic two-token branch at the root (the likeliest token
    after the drafter's top choice, as an n-gram continuation would be): many siblings to test at every node."""
    spine, rows, branches = [], [], []
    for j in range(depth):
        q = drafter(prefix + tuple(spine))
        x = int(torch.multinomial(q, 1, generator=generator))
        order = [int(t) for t in q.argsort(descending=True) if int(t) != x]
        branches.append(Branch(j, (order[0],)))
        spine.append(x)
        rows.append(q)
    top = int(drafter(prefix).argmax())
    branches.append(Branch(0, (top, int(drafter(prefix + (top,)).argmax()))))
    flat = flatten(spine, branches)
    q = torch.zeros(len(flat.tokens), VOCAB, dtype=torch.float64)
    q[: len(spine)] = torch.stack(rows)  # the spine was sampled; the branches are deterministic (zero rows)
    p = torch.stack([target(prefix)] + [target(prefix + _path(flat, n)) for n in range(len(flat.tokens))])
    committed, _ = verify_tree_sampling(flat, p, q, *tree_draws(len(flat.tokens), generator))
    return committed


def _path(flat, node):
    out = []
    while node != ROOT:
        out.append(flat.tokens[node])
        node = flat.parents[node]
    return tuple(reversed(out))


def test_sampling_over_siblings_commits_the_verifiers_joint_distribution():
    generator = torch.Generator().manual_seed(7)
    n = samples(20_000)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            out += _tree_round(tuple(out), generator)
        counts[out[0], out[1]] += 1
    exact = torch.tensor([[float(target(())[a] * target((a,))[b]) for b in range(VOCAB)] for a in range(VOCAB)])
    _, p_value = chisquare(counts.flatten().numpy(), (exact.flatten() * n).numpy())
    assert p_value > 1e-3, (counts / n, exact)


def test_greedy_tree_commits_the_verifiers_greedy_path():
    for prefix in itertools.product(range(VOCAB), repeat=2):
        spine = [int(drafter(prefix).argmax())]
        spine.append(int(drafter(prefix + (spine[0],)).argmax()))
        second = int(drafter(prefix).argsort(descending=True)[1])
        flat = flatten(spine, [Branch(0, (second,)), Branch(1, (int(drafter(prefix + (spine[0],)).argsort()[-2]),))])
        chosen = [int(target(prefix + _path(flat, n)).argmax()) for n in [ROOT, *range(len(flat.tokens))]]
        committed, _ = verify_tree_matching(flat, chosen)
        expected, context = [], prefix
        for _ in committed:
            expected.append(int(target(context).argmax()))
            context = context + (expected[-1],)
        assert committed == expected


def test_a_drafters_tree_spends_its_budget_on_its_likeliest_paths():
    """A model's draft tree: the spine is the chain it would draft; beside it at most ``siblings`` × depth branch
    nodes, each branch forking with one of the drafter's top tokens at its fork and continuing with its argmax; the
    budget goes to continuing likely forks where they are worth more than further siblings, and with one sibling
    and a deep draft some branch is longer than a token; every kept node is worth at least any node left out that
    could have been kept in its place (its parent kept)."""
    drafter = TableModel("drafter", seed=3, scale=1.0)
    contexts = [[a, b] for a in range(6) for b in range(2)]
    depth, siblings = 5, 1
    chains = draft_tokens(drafter, list(range(len(contexts))), contexts, [depth] * len(contexts), [], [None] * 12)
    trees = draft_tree(drafter, list(range(len(contexts))), contexts, [depth] * len(contexts), [], [None] * 12, siblings)

    def probs(path):
        return torch.softmax(drafter.logits_after(path).double(), 0)

    def value(path_from_context, context):
        v = 1.0
        for i, token in enumerate(path_from_context):
            v *= float(probs(context + path_from_context[:i])[token])
        return v

    longest = 0
    for context, (spine, _), tree in zip(contexts, chains, trees):
        assert tree.tokens == spine and tree.probs is None
        assert sum(len(b.tokens) for b in tree.branches) <= siblings * depth
        kept, paths = [], set()
        for branch in tree.branches:
            head = spine[: branch.at]
            top = probs(context + head).topk(siblings + 1).indices.tolist()
            assert branch.tokens[0] in top and branch.tokens[0] != spine[branch.at]
            for i in range(1, len(branch.tokens)):
                assert branch.tokens[i] == int(drafter.logits_after(context + head + list(branch.tokens[:i])).argmax())
            assert branch.at + len(branch.tokens) <= depth
            for i in range(len(branch.tokens)):
                path = head + list(branch.tokens[: i + 1])
                kept.append(value(path, context))
                paths.add(tuple(path))
            longest = max(longest, len(branch.tokens))
        # what could have been kept instead: a fork not taken, or the next token of a kept branch
        left_out = []
        for at in range(depth):
            for token in probs(context + spine[:at]).topk(siblings + 1).indices.tolist():
                if token != spine[at] and (*spine[:at], token) not in paths:
                    left_out.append(value(spine[:at] + [token], context))
        for path in paths:
            more = int(drafter.logits_after(context + list(path)).argmax())
            if len(path) < depth and (*path, more) not in paths and (*path, more) != tuple(spine[: len(path) + 1]):
                left_out.append(value(list(path) + [more], context))
        if len(kept) == siblings * depth and left_out:
            assert min(kept) >= max(left_out) - 1e-6
    assert longest > 1
