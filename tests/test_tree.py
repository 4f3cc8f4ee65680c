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
from tests.test_engine_sampling import samples

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
