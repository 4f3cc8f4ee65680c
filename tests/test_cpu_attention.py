"""The CPU attention kernel (kernels/cpu_attention.cpp), compiled here with the system's compiler: every query row
attends exactly its own sequence's cached keys, whatever else is in the batch; bad input is an error; and without a
compiler the lean forward keeps SDPA and says why."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cascade.stages import cpu_attention


def _explicit(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scale)·V in float64, one query row [heads, D] over [kv_heads, L, D] keys and values."""
    group = q_row.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)  # [heads, L, D]
    v = values.double().repeat_interleave(group, dim=0)
    weights = torch.softmax(torch.einsum("hd,hld->hl", q_row.double(), k) * scale, dim=-1)
    return torch.einsum("hl,hld->hd", weights, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [8, 64, 128], ids=lambda d: f"head_dim{d}")
@pytest.mark.usefixtures("cpu_kernel")
def test_each_row_attends_exactly_its_own_sequences_keys(dtype, head_dim):
    """Sequences in scattered slots with 1 to 16 new rows and different cached lengths, grouped query heads: row i
    of a sequence sees its keys 0 .. start + i and nothing past them (the positions after hold garbage)."""
    generator = torch.Generator().manual_seed(head_dim)
    slots, kv_heads, heads, capacity = 9, 2, 8, 300
    cache = torch.randn(2, slots, kv_heads, capacity, head_dim, generator=generator, dtype=dtype) * 3
    keys, values = cache[0], cache[1]
    sequences = [(7, 0, 5), (2, 120, 1), (4, 31, 16), (0, 250, 1), (8, 3, 2)]  # (slot, cached before, new rows)
    rows = sum(n for _, _, n in sequences)
    query = torch.randn(rows, heads, head_dim, generator=generator, dtype=dtype)
    cu_rows = [0]
    for _, _, n in sequences:
        cu_rows.append(cu_rows[-1] + n)
    got = cpu_attention.ragged_attention(
        query, keys, values, torch.tensor([s for s, _, _ in sequences]), torch.tensor([c for _, c, _ in sequences]),
        torch.tensor(cu_rows), head_dim**-0.5,
    )
    assert got.shape == query.shape and got.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for (slot, cached, n), first in zip(sequences, cu_rows):
        for i in range(n):
            end = cached + i + 1
            expected = _explicit(query[first + i], keys[slot, :, :end], values[slot, :, :end], head_dim**-0.5)
            torch.testing.assert_close(got[first + i].double(), expected, **tolerance)


@pytest.mark.usefixtures("cpu_kernel")
def test_a_call_split_across_threads_equals_its_sequences_one_by_one():
    """A batch split across threads (64 sequences of up to 700 positions) gives each row, bit for bit, what that
    sequence alone gives, however small its call: a row's sums run in the same order whichever thread computes it and
    however the call is split into chunks."""
    generator = torch.Generator().manual_seed(0)
    slots, kv_heads, heads, head_dim, capacity = 64, 2, 4, 64, 704
    cache = torch.randn(2, slots, kv_heads, capacity, head_dim, generator=generator)
    starts = torch.randint(0, capacity - 4, (slots,), generator=generator)
    widths = torch.randint(1, 4, (slots,), generator=generator)
    cu_rows = torch.cat([torch.zeros(1, dtype=torch.long), widths.cumsum(0)])
    query = torch.randn(int(cu_rows[-1]), heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    together = cpu_attention.ragged_attention(query, cache[0], cache[1], torch.arange(slots), starts, cu_rows, scale)
    for b in range(slots):
        rows = slice(int(cu_rows[b]), int(cu_rows[b + 1]))
        alone = cpu_attention.ragged_attention(query[rows].contiguous(), cache[0], cache[1], torch.tensor([b]),
                                               starts[b : b + 1], torch.tensor([0, int(widths[b])]), scale)
        assert torch.equal(together[rows], alone), f"sequence {b}"


@pytest.mark.usefixtures("cpu_kernel")
def test_bad_input_is_an_error_not_a_crash():
    keys = values = torch.zeros(2, 1, 16, 8)
    query = torch.zeros(3, 2, 8)
    good = dict(seq_slot=torch.tensor([1]), seq_start=torch.tensor([4]), cu_rows=torch.tensor([0, 3]))

    def call(**changes):
        args = {**good, **changes}
        return cpu_attention.ragged_attention(query, keys, values, args["seq_slot"], args["seq_start"],
                                              args["cu_rows"], 0.5)

    assert call().shape == query.shape
    with pytest.raises(RuntimeError, match="past the cache's capacity"):
        call(seq_start=torch.tensor([14]))  # rows at positions 14, 15, 16 of a 16-position cache
    with pytest.raises(RuntimeError, match="slot out of range"):
        call(seq_slot=torch.tensor([2]))
    with pytest.raises(RuntimeError, match="cu_rows"):
        call(cu_rows=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_attention.ragged_attention(query.double(), keys, values, *good.values(), 0.5)


@pytest.mark.usefixtures("cpu_kernel")
def test_loading_the_kernel_leaves_the_process_floating_point_alone():
    """The kernel is compiled with -ffast-math; a library linked with it would turn on flush-to-zero for the whole
    process as it loads (found by the OpenAPI fuzzer, whose float strategies check for it)."""
    cpu_attention.load()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in float32
    assert (tiny * 1.0).item() > 0 and (tiny / 2).item() > 0


@pytest.mark.usefixtures("cpu_kernel")
def test_the_choice_follows_the_setting_and_the_tensors(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_attention.use_kernel(cpu, torch.float32) and cpu_attention.use_kernel(cpu, torch.float64)
    assert not cpu_attention.use_kernel(cpu, torch.bfloat16)  # auto: SDPA where the kernel does not run
    assert not cpu_attention.use_kernel(cpu, torch.float32, "sdpa")
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_attention.use_kernel(cpu, torch.bfloat16, "kernel")
    monkeypatch.setenv(cpu_attention.ENV_VAR, "sdpa")
    assert not cpu_attention.use_kernel(cpu, torch.float32, "kernel")  # the environment overrides the argument
    monkeypatch.setenv(cpu_attention.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="CASCADE_ATTENTION"):
        cpu_attention.use_kernel(cpu, torch.float32)


@pytest.mark.slow  # a Python process
def test_without_a_compiler_the_lean_forward_keeps_sdpa_and_says_why(tmp_path):
    """A machine without a C++ compiler (CXX names none, and no build is cached): ``auto`` warns once and the
    lean forward still computes transformers' logits; asking for the kernel is an error that says why."""
    script = textwrap.dedent("""
        import logging, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from cascade.stages import cpu_attention
        from cascade.stages.lean import LeanDecoder
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        tokens = [3, 1, 4, 1, 5, 9, 2, 6]
        expected = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        lean = LeanDecoder(model.eval())
        assert not lean.kernel
        cache = lean.new_cache()
        with torch.inference_mode():
            got = lean.forward(cache, [cache.allocate()], [tokens], [1])[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
        try:
            cpu_attention.use_kernel(torch.device("cpu"), torch.float32, "kernel")
        except cpu_attention.KernelUnavailable as e:
            print("refused:", e)
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop(cpu_attention.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("the CPU attention kernel is unavailable") == 1 and "no-such-compiler" in done.stderr
    assert "refused: compiling cpu_attention.cpp failed" in done.stdout


@pytest.mark.usefixtures("cpu_kernel")
def test_kernels_build_compiles_the_cpu_kernel(capsys):
    from cascade.cli import main

    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    assert f"CPU attention kernel: {cpu_attention.library_path()}" in out and cpu_attention.library_path().is_file()
    if not torch.cuda.is_available():
        assert "no GPU" in out
