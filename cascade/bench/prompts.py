"""Benchmark prompts: a fixed, seeded selection from the zoo's held-out corpus, or a user's file."""

from __future__ import annotations

import json
import random
from pathlib import Path

from cascade.zoo.corpus import load_corpus

# Prompt lengths in characters: short, medium and long contexts, so drafting is tried on all three.
_LENGTHS = (120, 400, 1200)


def held_out_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` prompts cut from held-out stdlib files at line boundaries, of varied lengths."""
    documents = [d for d in load_corpus().held_out if len(d.text) > 2 * max(_LENGTHS)]
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        doc = documents[rng.randrange(len(documents))]
        length = _LENGTHS[i % len(_LENGTHS)]
        start = doc.text.rfind("\n", 0, rng.randrange(0, len(doc.text) - length)) + 1
        end = doc.text.rfind("\n", start, start + length) + 1 or start + length
        prompts.append(doc.text[start:end])
    return prompts


def file_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or JSON lines with a ``prompt`` field (which may contain newlines)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {str(path)!r} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON: {e}") from None
            if not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise ValueError(f"{path}:{number}: a JSON line needs a non-empty string field 'prompt'")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {str(path)!r} contains no prompts")
    return prompts
