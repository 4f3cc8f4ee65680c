"""The text the demo families learn from.

By default: the Python standard library's own ``.py`` sources, which every machine with Python has. Files are
split into train and held-out parts by a hash of their relative path, so the split is deterministic and does
not depend on the order the file system lists them in.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories of the standard library that are not "the library": the test suite (huge and repetitive),
# third-party packages (they differ from machine to machine) and the IDLE editor.
_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})

HELD_OUT_EVERY = 20  # one file in 20 goes to the held-out part


@dataclass(frozen=True, slots=True)
class Document:
    name: str  # path relative to the corpus root, with forward slashes
    text: str


@dataclass(frozen=True, slots=True)
class Corpus:
    root: str
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]

    @property
    def train_chars(self) -> int:
        return sum(len(d.text) for d in self.train)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(name: str) -> bool:
    digest = hashlib.sha1(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_EVERY == 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few stdlib files are deliberately not UTF-8; they are not worth learning from


def _split_text_file(path: Path) -> list[Document]:
    """One text file becomes documents at blank-line-separated paragraphs, grouped into ~20 kB chunks."""
    text = _read(path)
    if text is None:
        raise ValueError(f"--corpus {str(path)!r} is not a readable UTF-8 text file")
    chunks, current, size = [], [], 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= 20_000:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return [Document(f"{path.name}#{i}", chunk) for i, chunk in enumerate(chunks)]


def load_corpus(path: str | Path | None = None) -> Corpus:
    """Load a corpus: the stdlib sources (``path=None``), every text file under a directory, or one text file."""
    if path is None:
        root = stdlib_root()
        files = [p for p in root.rglob("*.py") if not _SKIPPED_PARTS.intersection(p.relative_to(root).parts)]
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"--corpus {str(path)!r} does not exist")
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    documents: list[Document] = []
    if root.is_file():
        documents = _split_text_file(root)
    else:
        for file in sorted(files):
            text = _read(file)
            if text and text.strip():
                documents.append(Document(file.relative_to(root).as_posix(), text))
    documents = [d for d in documents if d.text.strip()]
    train = tuple(d for d in documents if not _is_held_out(d.name))
    held_out = tuple(d for d in documents if _is_held_out(d.name))
    if not train or not held_out:
        raise ValueError(
            f"corpus {str(root)!r} has {len(documents)} non-empty documents; need enough for both a train and a "
            f"held-out part (one document in {HELD_OUT_EVERY} is held out)"
        )
    return Corpus(str(root), train, held_out)
