"""The offline model family: plain-transformers loading, the tokenizer, idempotent and crash-safe builds."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade.zoo import build_family, family_status, get_preset
from cascade.zoo.build import FAMILY_FILE

REPO = Path(__file__).resolve().parents[1]


def test_members_load_with_plain_transformers_and_generate(tiny_family):
    names = list(tiny_family.info["members"])
    assert names == ["small", "medium", "target"]
    for name in names:
        path = str(tiny_family.member_path(name))
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer("def main():", return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
        assert out.shape[1] > ids["input_ids"].shape[1]
        assert isinstance(tokenizer.decode(out[0]), str)
    params = [tiny_family.info["members"][n]["parameters"] for n in names]
    assert params == sorted(params) and len(set(params)) == 3


def test_family_json_reports_losses_and_agreement(tiny_family):
    info = json.loads((tiny_family.path / FAMILY_FILE).read_text())
    for member in info["members"].values():
        assert member["parameters"] > 0 and 0 < member["held_out_loss"] < 10
    assert set(info["agreement"]) == {"small->medium", "small->target", "medium->target"}
    assert all(0.0 <= v <= 1.0 for v in info["agreement"].values())


def test_tokenizer_round_trips_arbitrary_text(tiny_family):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_family.member_path("target")))
    rng = random.Random(0)
    samples = [
        "",
        "plain ascii",
        "  leading and trailing spaces  \n\n\t",
        "naïve café — Ünïcödé ✓ 日本語 🙂 العربية \u200b zero-width",
        "\x00\x01 control \x7f",
        "<|endoftext|> looks special but is text here",
    ]
    for _ in range(50):  # random code points across planes, surrogates excluded
        chars = [chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF), rng.randrange(0xE000, 0x10FFFF)])) for _ in range(rng.randrange(1, 40))]
        samples.append("".join(chars))
    for text in samples[:5] + samples[6:]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == "<|endoftext|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_rebuild_is_a_no_op(tiny_family, capsys):
    stamp = (tiny_family.path / FAMILY_FILE).stat().st_mtime_ns
    started = time.perf_counter()
    again = build_family("tiny", progress=True)
    assert time.perf_counter() - started < 5  # nothing was trained again
    assert again.path == tiny_family.path
    assert (tiny_family.path / FAMILY_FILE).stat().st_mtime_ns == stamp
    assert "reusing the 'tiny' family" in capsys.readouterr().err  # it says it reused it, not that it built it


def _small_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = Path(os.__file__).parent
    for name in ["os.py", "json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "shlex.py", "heapq.py", "bisect.py",
                 "fnmatch.py", "glob.py", "copy.py", "abc.py", "keyword.py", "token.py", "colorsys.py", "numbers.py",
                 "operator.py", "functools.py", "random.py", "statistics.py", "calendar.py", "pprint.py", "reprlib.py",
                 "queue.py", "sched.py", "contextlib.py", "dataclasses.py", "enum.py", "typing.py", "argparse.py"]:
        (corpus / name.replace("/", "_")).write_text((stdlib / name).read_text())
    return corpus


@pytest.mark.slow  # a build process, killed
def test_interrupted_build_is_detected_and_redone(tmp_path):
    out = tmp_path / "fam"
    corpus = _small_corpus(tmp_path)
    # the tiny preset with a tenth of its training: the build is still what is interrupted and redone, sooner
    short = "dataclasses.replace(get_preset('tiny'), target_steps=25, distill_steps=15, eval_prompts=2)"
    code = (
        "import dataclasses; from cascade.zoo import build_family; from cascade.zoo.presets import get_preset; "
        f"build_family({short}, {str(out)!r}, corpus={str(corpus)!r}, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    partial = out.with_name("fam.partial")
    deadline = time.monotonic() + 120
    while not partial.exists() and time.monotonic() < deadline:  # the build has started writing
        time.sleep(0.05)
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    assert family_status(out) == "incomplete"
    with pytest.raises(FileNotFoundError, match="no complete model family"):
        from cascade.zoo import load_family

        load_family(out)
    family = build_family(dataclasses.replace(get_preset("tiny"), target_steps=25, distill_steps=15, eval_prompts=2),
                          out, corpus=corpus, progress=False)
    assert family_status(out) == "complete" and not partial.exists()
    assert family.info["corpus"] == str(corpus.resolve())


def test_bad_arguments_give_clear_errors(tmp_path, tiny_family):
    with pytest.raises(ValueError, match="unknown zoo preset 'huge'"):
        build_family("huge", tmp_path / "x")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        build_family("tiny", tmp_path / "x", seed=-1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_family("tiny", tmp_path / "x", corpus=tmp_path / "missing", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="non-empty documents"):
        build_family("tiny", tmp_path / "x", corpus=empty, progress=False)
    # A complete family built with other settings is never silently overwritten.
    with pytest.raises(FileExistsError, match="--force"):
        build_family("tiny", tiny_family.path, seed=1, progress=False)


@pytest.mark.slow  # a CLI process
def test_cli_reports_errors_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cascade.cli", "zoo", "build", "--preset", "tiny", "--out", str(tmp_path / "f"),
         "--corpus", str(tmp_path / "nothing")],
        capture_output=True, text=True, cwd=REPO,
    )
    assert result.returncode == 2
    assert "cascade: error:" in result.stderr and "Traceback" not in result.stderr


def test_presets_meet_their_size_contract():
    demo = get_preset("demo")
    from cascade.zoo.train import make_model, num_parameters

    sizes = [num_parameters(make_model(m, demo, eos_token_id=0, seed=0)) for m in demo.members]
    assert len(sizes) == 3 and sizes[-1] >= 8 * sizes[0]
    bench = get_preset("bench")
    assert num_parameters(make_model(bench.target, bench, eos_token_id=0, seed=0)) >= 30_000_000
    assert torch.get_num_threads() >= 1
