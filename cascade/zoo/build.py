"""``cascade zoo build``: make a family of models offline and save it as Hugging Face directories.

A family directory is complete exactly when its ``family.json`` exists: the build writes everything into a
sibling ``<out>.partial`` directory and renames it into place as its last step, so an interrupted build never
leaves a directory that looks complete. A file lock keeps two processes from building the same family at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from cascade.zoo.corpus import Corpus, load_corpus
from cascade.zoo.evaluate import agreement_rates, held_out_loss
from cascade.zoo.presets import Preset, get_preset
from cascade.zoo.tokenizer import save_tokenizer, train_tokenizer
from cascade.zoo.train import WindowSampler, distill, make_model, num_parameters, train_target

FAMILY_FILE = "family.json"
CONFIG_FILE = "cascade.yaml"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Family:
    path: Path
    info: dict  # the contents of family.json

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    def member_path(self, name: str) -> Path:
        return self.path / name


def recipe(spec: Preset) -> str:
    """A fingerprint of everything that shapes a family, so a cached family built by another recipe is redone."""
    return hashlib.sha1(f"{FORMAT_VERSION}:{spec!r}".encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cascade" / "zoo"


def default_family_dir(preset: str) -> Path:
    return default_cache_dir() / preset


def family_status(out: str | Path) -> str:
    """``"complete"``, ``"missing"``, or ``"incomplete"`` (an interrupted build left files behind)."""
    out = Path(out).expanduser()
    if (out / FAMILY_FILE).is_file():
        return "complete"
    partial = out.with_name(out.name + ".partial")
    if partial.exists() or (out.exists() and any(out.iterdir())):
        return "incomplete"
    return "missing"


def load_family(out: str | Path) -> Family:
    out = Path(out).expanduser()
    if family_status(out) != "complete":
        raise FileNotFoundError(f"no complete model family at {str(out)!r} (run `cascade zoo build`)")
    return Family(out, json.loads((out / FAMILY_FILE).read_text()))


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_family(
    preset: str | Preset = "demo",
    out: str | Path | None = None,
    *,
    corpus: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    force: bool = False,
) -> Family:
    """Build (or reuse) a model family; returns it once ``out`` holds a complete one.

    An existing complete family built with the same preset, seed and corpus is reused as it is; one built with
    different settings is an error unless ``force`` is set, so a cache is never silently overwritten.
    """
    spec = preset if isinstance(preset, Preset) else get_preset(preset)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed!r}")
    out = Path(out).expanduser() if out is not None else default_family_dir(spec.name)
    corpus_id = "stdlib" if corpus is None else str(Path(corpus).expanduser().resolve())
    with _lock(out):
        if family_status(out) == "complete":
            family = load_family(out)
            wanted = {"preset": spec.name, "seed": seed, "corpus": corpus_id}
            got = {k: family.info.get(k) for k in wanted}
            if got != wanted and not force:
                raise FileExistsError(
                    f"{str(out)!r} holds a family built with {got}, not {wanted}; "
                    "pass --force to rebuild it or choose another --out"
                )
            if got == wanted and family.info.get("recipe") == recipe(spec) and not force:
                _say(progress, f"reusing the {spec.name!r} family already built at {out} (--force rebuilds it)")
                return family
            if got == wanted and not force:
                _say(progress, f"the family at {out} was built by an older recipe of {spec.name!r}; rebuilding")
        elif family_status(out) == "incomplete":
            _say(progress, f"found an interrupted build at {out}; starting over")
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        info = _build_into(partial, spec, load_corpus(corpus), corpus_id, seed, progress)
        # family.json is written last, then the whole directory is swapped in.
        (partial / FAMILY_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
        _write_config(out, spec)  # paths inside name the final location
        family = load_family(out)
    _say(progress, summary_table(family))
    return family


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _token_stream(corpus_docs, tokenizer, limit: int, seed: int) -> torch.Tensor:
    """Documents in a seeded order, each followed by EOS, tokenized until ``limit`` tokens."""
    docs = list(corpus_docs)
    random.Random(seed).shuffle(docs)
    ids: list[int] = []
    for start in range(0, len(docs), 64):
        for encoded in tokenizer([d.text for d in docs[start : start + 64]])["input_ids"]:
            ids.extend(encoded)
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit], dtype=torch.long)


def _tokenizer_texts(corpus: Corpus, chars: int, seed: int) -> list[str]:
    docs = list(corpus.train)
    random.Random(seed + 1).shuffle(docs)
    texts, total = [], 0
    for d in docs:
        texts.append(d.text)
        total += len(d.text)
        if total >= chars:
            break
    return texts


def _build_into(directory: Path, spec: Preset, corpus: Corpus, corpus_id: str, seed: int, progress: bool) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    _say(progress, f"building the {spec.name!r} family from {corpus.root} ({len(corpus.train)} train files)")
    tokenizer = train_tokenizer(_tokenizer_texts(corpus, spec.tokenizer_chars, seed), spec.vocab_size, progress=progress)
    if len(tokenizer) < spec.vocab_size // 2:
        raise ValueError(f"corpus too small: the tokenizer learned only {len(tokenizer)} of {spec.vocab_size} tokens")
    eos = tokenizer.eos_token_id
    train_stream = _token_stream(corpus.train, tokenizer, spec.corpus_tokens, seed)
    held_stream = _token_stream(corpus.held_out, tokenizer, 1 << 40, seed)  # all of it

    models = [make_model(m, spec, eos_token_id=eos, seed=seed + i) for i, m in enumerate(spec.members)]
    target = models[-1]
    train_target(target, WindowSampler(train_stream, spec.seq_len, spec.batch_size, seed), spec, progress=progress)
    distill_sampler = WindowSampler(train_stream, spec.seq_len, spec.distill_batch_size, seed + 1)
    distill(models[:-1], target, distill_sampler, spec, progress=progress)

    # Held-out loss over windows spread evenly across every held-out file, not just the first few.
    starts = torch.linspace(0, held_stream.numel() - spec.seq_len, 48).long().unique()
    windows = torch.stack([held_stream[s : s + spec.seq_len] for s in starts.tolist()])  # [windows, seq_len]
    gen = torch.Generator().manual_seed(seed)
    plen = spec.eval_prompt_tokens
    starts = torch.randint(0, held_stream.numel() - plen, (spec.eval_prompts,), generator=gen)
    prompts = torch.stack([held_stream[s : s + plen] for s in starts.tolist()])  # [eval_prompts, plen]
    names = [m.name for m in spec.members]
    agreement = agreement_rates(models, names, prompts, spec.eval_new_tokens)

    members = {}
    for member, model in zip(spec.members, models):
        model.save_pretrained(str(directory / member.name))
        save_tokenizer(tokenizer, directory / member.name)
        members[member.name] = {
            "parameters": num_parameters(model),
            "held_out_loss": round(held_out_loss(model, windows), 4),
            "hidden_size": member.hidden_size,
            "num_layers": member.num_layers,
        }
    return {
        "format_version": FORMAT_VERSION,
        "preset": spec.name,
        "recipe": recipe(spec),
        "seed": seed,
        "corpus": corpus_id,
        "vocab_size": len(tokenizer),
        "train_tokens_seen": spec.target_steps * spec.batch_size * spec.seq_len,
        "members": members,  # smallest first; the last is the target
        "agreement": {k: round(v, 4) for k, v in agreement.items()},
        "build_seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
    }


def _write_config(out: Path, spec: Preset) -> None:
    stages: list[dict] = [{"name": "ngram", "type": "ngram", "max_ngram": 3, "depth": spec.ngram_depth}]
    for member in spec.members:
        stage = {"name": member.name, "type": "hf", "model": str(out / member.name)}
        if member is not spec.target:
            stage["depth"] = spec.model_depth
        stages.append(stage)
    config = {"served_model_name": f"cascade-{spec.name}", "stages": stages, "controller": {"mode": "fixed"}}
    (out / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))


def summary_table(family: Family) -> str:
    info = family.info
    lines = [f"family {info['preset']!r} at {family.path} (built in {info['build_seconds']} s)"]
    lines.append(f"  {'member':<10} {'params':>12} {'held-out loss':>14}")
    for name, m in info["members"].items():
        lines.append(f"  {name:<10} {m['parameters']:>12,} {m['held_out_loss']:>14.3f}")
    lines.append("  greedy agreement along the target's continuation:")
    for pair, rate in info["agreement"].items():
        lines.append(f"    {pair:<20} {rate:.3f}")
    return "\n".join(lines)
