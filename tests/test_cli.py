"""`cascade generate`: JSON and streaming output agree with the Python API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cascade import Cascade

pytestmark = pytest.mark.slow  # a CLI process each

REPO = Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cascade.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_generate_json_matches_python_api(tiny_family):
    config = str(tiny_family.config_path)
    done = _cli("generate", "--config", config, "--max-tokens", "24", "--json", "class Foo:")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats", "tokens_per_second"}
    expected = Cascade.from_config(config, progress=False).generate("class Foo:", max_tokens=24)
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    stages = out["stats"]["stages"]
    assert list(stages) == ["ngram", "small", "medium", "target"]
    assert stages["small"]["drafted"] >= stages["small"]["accepted"] >= 0
    assert out["stats"]["generated_tokens"] == len(out["token_ids"])


def test_generate_streams_plain_text(tiny_family):
    config = str(tiny_family.config_path)
    done = _cli("generate", "--config", config, "--max-tokens", "24", "--temperature", "0.8", "--seed", "3",
                "--top-p", "0.9", "--stop", "\n\n", "import os")
    assert done.returncode == 0, done.stderr
    expected = Cascade.from_config(config, progress=False).generate(
        "import os", max_tokens=24, temperature=0.8, seed=3, top_p=0.9, stop=["\n\n"]
    )
    assert done.stdout == expected.text  # stdout is exactly the completion; the summary goes to stderr
    assert "tokens/s" in done.stderr


def test_generate_rejects_bad_arguments(tiny_family, capsys):
    """Exit code 2 and a one-line message (the CLI's ``main``, in this process: the exit code a process gets is its
    return value; an exception would fail the test here as a traceback would there)."""
    from cascade.cli import main

    config = str(tiny_family.config_path)
    for args, fragment in [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--max-tokens", "100000"], "context window"),
    ]:
        assert main(["generate", "--config", config, *args, "x = 1"]) == 2
        assert fragment in capsys.readouterr().err
    assert main(["generate", "--config", str(REPO / "nope.yaml"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # Sampling arguments are checked before anything loads (here: before the config is even read).
    assert main(["generate", "--config", str(REPO / "nope.yaml"), "--temperature", "-1", "x"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_the_command_line_and_its_argument_errors_do_not_load_transformers():
    """`import cascade`, the CLI's parser and a bad argument to `generate` load neither transformers nor a model, a
    missing config for `serve` not even torch (the package imports its names when first used), so a mistake is
    reported at once; the names still resolve."""
    code = (
        "import sys, cascade, cascade.cli\n"
        "assert cascade.cli.main(['serve', '--config', 'nope.yaml']) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was loaded'\n"
        "assert cascade.cli.main(['generate', '--temperature', '-1', 'x']) == 2\n"
        "assert cascade.cli.main(['generate', '--config', 'nope.yaml', 'x']) == 2\n"
        "assert 'transformers' not in sys.modules, 'transformers was loaded'\n"
        "from cascade import Cascade, load_config\n"
        "from cascade.zoo import PRESETS, build_family\n"
        "assert 'transformers' in sys.modules and callable(load_config) and 'tiny' in PRESETS\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "temperature" in done.stderr and "does not exist" in done.stderr
