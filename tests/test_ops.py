"""The verification op's implementations agree exactly with the PyTorch reference (the drawn token could differ only
where a draw falls within float64 rounding of a boundary between two tokens, which these cases never do).

Triton runs under its interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py before Triton is imported when
there is no GPU); the HIP kernels are compiled into real AMD code objects with hipcc; GPU tests build the native kernels
for the local GPU and are skipped without one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import hf_stage, perturbed_copy, random_llama

from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.verify import Verifier, reference
from cascade.verify.tree import (
    Branch,
    flatten,
    spine_length,
    tree_draws,
    verify_tree_matching,
    verify_tree_sampling,
    verify_trees_matching,
    verify_trees_sampling,
)

triton_kernels = pytest.importorskip("cascade.verify.triton_kernels", reason="Triton is not installed")
KERNELS = Path(__file__).resolve().parent.parent / "kernels"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ragged_case(seed: int, batch: int, max_depth: int, vocab: int, *, kind: str, pad: int = 0):
    """Random drafts of random depths (0 included) plus the edge cases named by ``kind``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_depth + 1, (batch,), generator=g)
    lengths[0] = 0  # a request with depth 0 (only the bonus token)
    lengths[-1] = max_depth
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    num_tokens = int(cu[-1])
    width = vocab + pad  # padded vocabulary: the extra columns have probability 0
    p = torch.zeros(num_tokens + batch, width)
    p[:, :vocab] = torch.softmax(torch.randn(num_tokens + batch, vocab, generator=g) * 3, dim=-1)
    q = torch.zeros(num_tokens, width)
    q[:, :vocab] = torch.softmax(torch.randn(num_tokens, vocab, generator=g) * 3, dim=-1)
    drafts = torch.randint(0, vocab, (num_tokens,), generator=g)
    request_of = torch.repeat_interleave(torch.arange(batch), lengths)
    target_rows = torch.arange(num_tokens) + request_of
    if kind == "all-accepted":
        q = p[target_rows].clone()  # q == p: every test u * q < p passes
        drafts = torch.multinomial(q[:, :vocab], 1, generator=g).squeeze(1)
    elif kind == "first-rejected":
        p[target_rows, drafts] = 0.0  # the target never takes the drafted token
        p[target_rows] /= p[target_rows].sum(-1, keepdim=True)
    elif kind == "zero-draft-prob":
        q[torch.arange(num_tokens), drafts] = 0.0  # the drafter gave its own token probability 0: reject
    elif kind == "near-ties":
        p = (p * 8).round() / 8  # many equal probabilities: argmax ties must go to the lowest index
        q = (q * 8).round() / 8
    uniforms = torch.rand(num_tokens, generator=g)
    finals = torch.rand(batch, generator=g)
    if kind == "row-edges":
        # The draws at the ends of [0, 1): the first token with weight and the last one (never a padded column
        # past it); half the drafts are rejected (p = 0 on them) and leave an empty residual, which falls back to p.
        p[:, :vocab] = 1.0 / vocab
        q = p[target_rows].clone()
        rejected = target_rows[::2]
        p[rejected, drafts[::2]] = 0.0
        finals = torch.tensor([0.0, 1.0 - 2.0**-24] * batch)[:batch]
    return drafts, cu, q, p, uniforms, finals


KINDS = ["random", "all-accepted", "first-rejected", "zero-draft-prob", "near-ties", "row-edges"]


def on(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_depth", [1, 4, 8])
def test_triton_sampling_matches_reference(kind, max_depth):
    for seed in range(3):
        drafts, cu, q, p, u, e = ragged_case(seed, batch=6, max_depth=max_depth, vocab=1500, kind=kind, pad=37)
        expected = reference.sampling(drafts, cu, q, p, u, e, max_depth)
        got = triton_kernels.sampling(*on(DEVICE, drafts, cu, q, p, u, e), max_depth)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), (kind, seed)
        if kind == "all-accepted":
            assert torch.equal(expected[1], cu[1:] - cu[:-1])
        if kind in ("first-rejected", "zero-draft-prob"):
            assert expected[1].max() == 0


@pytest.mark.parametrize("kind", ["random", "all-accepted", "first-rejected"])
def test_triton_ngram_drafts_match_reference(kind):
    """One-hot drafts (no draft probabilities): accept when u < p(token); residual is p without the token."""
    for seed in range(3):
        drafts, cu, _, p, u, e = ragged_case(seed, batch=5, max_depth=5, vocab=1200, kind=kind)
        expected = reference.sampling(drafts, cu, None, p, u, e, 5)
        got = triton_kernels.sampling(*on(DEVICE, drafts, cu, None, p, u, e), 5)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.parametrize("kind", ["random", "all-accepted", "near-ties"])
def test_triton_greedy_matches_reference(kind):
    for seed in range(3):
        drafts, cu, _, p, _, _ = ragged_case(seed, batch=7, max_depth=6, vocab=2100, kind=kind, pad=11)
        if kind == "all-accepted":
            rows = torch.arange(drafts.numel()) + torch.repeat_interleave(torch.arange(7), cu[1:] - cu[:-1])
            drafts = p[rows].argmax(-1)
        expected = reference.matching(drafts, cu, p.argmax(-1), 6)
        got = triton_kernels.matching_from_rows(*on(DEVICE, drafts, cu, p), 6)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])
        assert torch.equal(triton_kernels.argmax_rows(p.to(DEVICE)).cpu(), p.argmax(-1))


def test_triton_all_requests_without_drafts():
    cu = torch.zeros(4, dtype=torch.long)
    p = torch.softmax(torch.randn(3, 900, generator=torch.Generator().manual_seed(1)), -1)
    e = torch.rand(3, generator=torch.Generator().manual_seed(2))
    empty = torch.empty(0, dtype=torch.long)
    expected = reference.sampling(empty, cu, None, p, torch.empty(0), e, 3)
    got = triton_kernels.sampling(*on(DEVICE, empty, cu, None, p, torch.empty(0), e), 3)
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


def tree_case(seed: int, batch: int, vocab: int, *, kind: str):
    """Random draft trees (a sampled spine with deterministic siblings and branches, as the engine proposes them),
    and the verifier's rows over their nodes; ``kind`` "accepting" makes the verifier's rows the drafter's where the
    spine was sampled (the spine is then often accepted deep), "siblings" makes each node off the spine its parent
    row's likeliest token (accepted where the spine was rejected, against the residual), "rejecting" zeroes every
    node's token in its parent's row (nothing is accepted: the residuals run through every sibling)."""
    g = torch.Generator().manual_seed(seed)
    trees = []
    for b in range(batch):
        spine = torch.randint(0, vocab, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
        branches = []
        for _ in range(int(torch.randint(0, 4, (1,), generator=g)) if b else 0):  # request 0: a chain
            at = int(torch.randint(0, len(spine) + 1, (1,), generator=g))
            length = int(torch.randint(1, 3, (1,), generator=g))
            branches.append(Branch(at, tuple(torch.randint(0, vocab, (length,), generator=g).tolist())))
        trees.append(flatten(spine, branches))
    p = [torch.softmax(3 * torch.randn(len(t.tokens) + 1, vocab, generator=g), -1) for t in trees]
    q = [torch.zeros(len(t.tokens), vocab) for t in trees]
    for t, rows, verifier_rows in zip(trees, q, p):
        spine = spine_length(t)
        rows[:spine] = torch.softmax(3 * torch.randn(spine, vocab, generator=g), -1)
        if kind == "accepting":
            verifier_rows[:spine] = rows[:spine]  # row j (after node j - 1) is the drafter's row of spine node j
        for n, parent in enumerate(t.parents):
            if kind == "siblings" and n >= spine:
                t.tokens[n] = int(verifier_rows[parent + 1].argmax())
            if kind == "rejecting":
                verifier_rows[parent + 1, t.tokens[n]] = 0.0
    return trees, p, q


@pytest.mark.parametrize("kind", ["random", "accepting", "siblings", "rejecting"])
def test_triton_tree_verification_matches_reference(kind):
    """Both regimes over a batch of trees: the Triton kernels walk each tree to the same nodes and token."""
    triton_verifier, reference_verifier = Verifier("triton"), Verifier("reference")
    branched = 0
    for seed in range(4):
        trees, p, q = tree_case(seed, batch=5, vocab=300, kind=kind)
        chosen = [rows.argmax(-1) for rows in p]
        expected = verify_trees_matching(reference_verifier, trees, chosen)
        assert verify_trees_matching(triton_verifier, trees, on(DEVICE, *chosen)) == expected
        assert expected == [verify_tree_matching(t, c.tolist()) for t, c in zip(trees, chosen)]
        for drafts in (q, [None] * len(q)):  # sampled spines, and every node deterministic (n-gram trees)
            draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
            expected = verify_trees_sampling(reference_verifier, trees, p, drafts, draws)
            draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
            got = verify_trees_sampling(triton_verifier, trees, on(DEVICE, *p), on(DEVICE, *drafts), draws)
            assert got == expected, (kind, seed)
            # the reference walks the batch's trees together: as each tree walked alone by the rule itself
            draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
            alone = [verify_tree_sampling(t, rows, q_rows, *tree_draws(len(t.tokens), g))
                     for t, rows, q_rows, g in zip(trees, p, drafts, draws)]
            assert alone == expected, (kind, seed)
            if kind == "rejecting":
                assert all(not nodes for _, nodes in expected)
            branched += sum(bool(nodes) and nodes[-1] >= spine_length(t) for t, (_, nodes) in zip(trees, expected))
    assert branched > 0 or kind in ("rejecting", "accepting")  # a branch taken after its spine sibling was rejected


def test_the_reference_walks_a_batch_of_trees_as_each_alone():
    """The reference verifies a step's trees together (one tensor operation per sibling tested, across the batch): it
    gives what the rule gives each tree alone (:func:`verify_tree_sampling`), for the same draws. A vocabulary of 8
    makes rejected candidates carry mass, so a residual that is not updated shows in the tokens drawn after them."""
    reference_verifier, differ = Verifier("reference"), 0
    for seed in range(40):
        for kind in ("random", "siblings"):
            trees, p, q = tree_case(seed, batch=6, vocab=8, kind=kind)
            for drafts in (q, [None] * len(q)):
                draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
                together = verify_trees_sampling(reference_verifier, trees, p, drafts, draws)
                draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
                alone = [verify_tree_sampling(t, rows, q_rows, *tree_draws(len(t.tokens), g))
                         for t, rows, q_rows, g in zip(trees, p, drafts, draws)]
                assert together == alone, (seed, kind)
                differ += sum(len(nodes) < len(t.tokens) for t, (_, nodes) in zip(trees, together))
    assert differ > 100  # walks that ended on a rejection: the residuals decided the token drawn


@pytest.mark.parametrize("siblings", [0, 2])
def test_engine_is_lossless_with_the_triton_verifier(siblings):
    """A small cascade through the engine, with chains and with draft trees (two siblings beside each draft token):
    greedy equals the target's greedy decode; sampling with a seed gives exactly the tokens the reference verifier
    gives (the same random draws go into both)."""
    target = random_llama(64, 32, 2, seed=0, eos_token_id=None)
    draft = perturbed_copy(target, 0.1, seed=1).to(DEVICE)
    target = target.to(DEVICE)  # Triton compiles for the GPU where there is one (else it is interpreted)
    stages = [hf_stage("draft", draft), hf_stage("target", target)]
    prompt = [3, 9, 27, 17, 5]
    ids = torch.tensor([prompt], device=DEVICE)
    expected = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                               do_sample=False)[0, len(prompt):].tolist()
    engines = {impl: CascadeEngine(stages, [3], eos_token_id=None, verifier=Verifier(impl), siblings=[siblings, 0])
               for impl in ("reference", "triton")}
    greedy = engines["triton"].run(engines["triton"].add_request(prompt, SamplingParams(), 20))
    assert greedy.generated == expected
    assert greedy.stats.verifier == "triton"
    params = SamplingParams(temperature=0.9, top_p=0.95)
    branches = greedy.stats.stages[0].branch_tokens
    for seed in range(3):
        runs = {impl: e.run(e.add_request(prompt, params, 20, seed=seed)) for impl, e in engines.items()}
        assert runs["triton"].generated == runs["reference"].generated
        branches += runs["triton"].stats.stages[0].branch_tokens
    assert (branches > 0) == (siblings > 0)  # trees were verified where asked for


def test_explicit_implementation_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.delenv("CASCADE_VERIFY_IMPL", raising=False)
    with pytest.raises(ValueError, match="one of"):
        Verifier("fastest")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="GPU"):
            Verifier("native").matching(torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]),
                                      torch.zeros(2, dtype=torch.long), 1)


def test_environment_variable_overrides_the_config(monkeypatch):
    monkeypatch.setenv("CASCADE_VERIFY_IMPL", "reference")
    verifier = Verifier("triton")
    verifier.matching(torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), 1)
    assert verifier.chosen == "reference"


# ---- HIP and CUDA compilation --------------------------------------------------------------------------------------


def test_hip_kernels_compile_to_amd_code_objects(tmp_path):
    if shutil.which("hipcc") is None:
        if os.environ.get("CASCADE_REQUIRE_HIPCC") == "1":
            pytest.fail("hipcc is required here (CASCADE_REQUIRE_HIPCC=1) but not installed")
        pytest.skip("hipcc is not installed (apt-get install hipcc libamdhip64-dev rocm-device-libs)")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run(["bash", str(KERNELS / "build_hip.sh"), str(tmp_path), "gfx90a", "gfx940"],
                            capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stderr  # -Wall -Wextra -Werror: any warning fails
    assert not any(scratch.iterdir())  # hipcc's intermediates are cleaned up, not left in the caller's TMPDIR
    library = tmp_path / "libcascade_verify.so"
    data = library.read_bytes()
    for arch in ("gfx90a", "gfx940"):
        assert f"amdgcn-amd-amdhsa--{arch}".encode() in data, f"no {arch} code object in {library}"


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-O3", "-Werror", "all-warnings", "-c", str(KERNELS / "verify_kernels.cu"),
         "-o", str(tmp_path / "verify_kernels.o")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


# ---- on a GPU --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_native_kernels_match_reference_on_gpu(kind):
    from cascade.verify import native

    module = native.load()
    for seed in range(3):
        drafts, cu, q, p, u, e = ragged_case(seed, batch=9, max_depth=8, vocab=32000, kind=kind, pad=64)
        expected = reference.sampling(drafts, cu, q, p, u, e, 8)
        got = module.sampling(*on("cuda", drafts, cu, q, p, u, e), 8)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])
        got = module.sampling(*on("cuda", drafts, cu, None, p, u, e), 8)
        expected = reference.sampling(drafts, cu, None, p, u, e, 8)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])
        assert torch.equal(module.argmax_rows(p.cuda()).cpu(), p.argmax(-1))
        got = module.greedy_accept(*on("cuda", drafts, cu, p.argmax(-1)), 8)
        expected = reference.matching(drafts, cu, p.argmax(-1), 8)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("kind", ["random", "accepting", "siblings", "rejecting"])
def test_native_tree_kernels_match_reference_on_gpu(kind):
    native_verifier, reference_verifier = Verifier("native"), Verifier("reference")
    for seed in range(4):
        trees, p, q = tree_case(seed, batch=7, vocab=32000, kind=kind)
        chosen = [rows.argmax(-1) for rows in p]
        expected = verify_trees_matching(reference_verifier, trees, chosen)
        assert verify_trees_matching(native_verifier, trees, on("cuda", *chosen)) == expected
        for drafts in (q, [None] * len(q)):
            draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
            expected = verify_trees_sampling(reference_verifier, trees, p, drafts, draws)
            draws = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
            assert verify_trees_sampling(native_verifier, trees, on("cuda", *p), on("cuda", *drafts), draws) == expected
