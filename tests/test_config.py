"""Configuration: the documented YAML shape loads; mistakes name the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cascade import Cascade, ConfigError, load_config
from cascade.config import packaged_config_path, parse_config

REPO = Path(__file__).resolve().parents[1]


def test_shipped_demo_config_loads():
    config = load_config(REPO / "configs" / "demo.yaml")
    assert [s.type for s in config.stages] == ["ngram", "hf", "hf", "hf"]
    assert config.target.name == "target"
    assert packaged_config_path("demo").resolve() == (REPO / "configs" / "demo.yaml").resolve()


def test_documented_example_loads(tmp_path):
    text = """
served_model_name: cascade-demo
stages:
  - name: ngram
    type: ngram
    max_ngram: 3
    depth: 4
  - name: small
    type: hf
    model: ~/.cache/cascade/zoo/demo/small
    device: auto
    dtype: auto
    depth: 4
  - name: target
    type: hf
    model: ~/.cache/cascade/zoo/demo/target
controller:
  mode: fixed
"""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    config = load_config(path)
    assert config.stages[1].depth == 4 and config.served_model_name == "cascade-demo"


def _stages(*extra):
    return {"stages": [*extra, {"name": "target", "type": "hf", "model": "m"}]}


@pytest.mark.parametrize(
    "data, fragment",
    [
        (_stages({"name": "x", "type": "lstm", "model": "m"}), "stages.0"),
        (_stages({"name": "x", "type": "hf"}), "stages.0.model"),
        (_stages({"name": "x", "type": "ngram", "depth": 0}), "stages.0.depth"),
        (_stages({"name": "x", "type": "hf", "model": "m", "depth": -2}), "stages.0.depth"),
        (_stages({"name": "x", "type": "hf", "model": "m", "device": "tpu"}), "stages.0.device"),
        (_stages({"name": "x", "type": "hf", "model": "m", "dtype": "int3"}), "stages.0.dtype"),
        (_stages({"name": "x", "type": "ngram", "max_ngram": 2, "min_ngram": 3}), "min_ngram"),
        (_stages({"name": "x", "type": "hf", "model": "m", "colour": "red"}), "stages.0.colour"),
        (_stages({"name": "target", "type": "ngram"}), "unique"),
        ({"stages": []}, "stages"),
        ({"stages": [{"name": "n", "type": "ngram"}]}, "target"),
        (_stages({"name": "a", "type": "hf", "model": "m"}, {"name": "n", "type": "ngram"}), "first stage"),
        ({**_stages(), "controller": {"mode": "psychic"}}, "controller.mode"),
    ],
)
def test_invalid_configs_name_the_key(data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_config(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_missing_model_directory(tmp_path):
    config = parse_config({"stages": [{"name": "target", "type": "hf", "model": str(tmp_path / "absent")}]})
    with pytest.raises(FileNotFoundError, match="target"):
        Cascade.from_config(config, progress=False)


def test_mismatched_tokenizers_are_refused(tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade.zoo.tokenizer import train_tokenizer

    # A copy of the small member with a tokenizer trained on different text.
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(str(tiny_family.member_path("small"))).save_pretrained(str(other))
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_family.member_path("target"))))
    train_tokenizer(["zebra quartz " * 200, "lorem ipsum " * 300], vocab, progress=False).save_pretrained(str(other))
    config = parse_config(
        {
            "stages": [
                {"name": "other", "type": "hf", "model": str(other)},
                {"name": "target", "type": "hf", "model": str(tiny_family.member_path("target"))},
            ]
        }
    )
    with pytest.raises(ConfigError, match="tokenizer"):
        Cascade.from_config(config, progress=False)


def test_zoo_cascade_yaml_is_a_valid_config(tiny_family):
    data = yaml.safe_load(tiny_family.config_path.read_text())
    config = parse_config(data)
    assert config.stages[0].type == "ngram"
    assert [s.name for s in config.stages[1:]] == list(tiny_family.info["members"])
