"""The training corpus: the running Python's standard library sources.

Deterministic: ``*.py`` under ``sysconfig``'s stdlib path, test directories and
``site-packages`` excluded, sorted by relative path. A file is held out when a stable
hash of its relative path falls in the held-out bucket, so the split is by file and
never changes between runs. Each document is ``BOS bytes EOS``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sys
import sysconfig

import numpy as np

from specjax.tokenizer import BOS_ID, EOS_ID

__all__ = ["Corpus", "build_corpus", "stdlib_files"]

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELD_OUT_PERCENT = 3


def stdlib_files(root: str | pathlib.Path | None = None) -> list[tuple[str, pathlib.Path]]:
    """``(relative path, path)`` of every corpus file, sorted by relative path."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib path {str(root)!r} is not a directory")
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        if not EXCLUDED_DIRS.intersection(rel.split("/")[:-1]) and f.is_file():
            out.append((rel, f))
    return sorted(out)


def is_held_out(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "little")
    return h % 100 < HELD_OUT_PERCENT


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams (``int32``, documents concatenated) and the files behind them."""

    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    source: str

    def describe(self) -> dict:
        return {
            "source": self.source,
            "train_files": len(self.train_files),
            "train_bytes": int(self.train.size),
            "held_out_files": len(self.held_out_files),
            "held_out_bytes": int(self.held_out.size),
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.train.astype(np.int32).tobytes())
        h.update(self.held_out.astype(np.int32).tobytes())
        return h.hexdigest()[:16]


def _stream(paths: list[pathlib.Path]) -> np.ndarray:
    parts = []
    for p in paths:
        data = np.frombuffer(p.read_bytes(), np.uint8).astype(np.int32)
        parts += [np.array([BOS_ID], np.int32), data, np.array([EOS_ID], np.int32)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def build_corpus(root: str | pathlib.Path | None = None, max_files: int | None = None) -> Corpus:
    """Build the split corpus (``max_files`` keeps the first N files, for smoke runs)."""
    files = stdlib_files(root)
    if max_files is not None:
        files = files[:max_files]
    train = [(r, p) for r, p in files if not is_held_out(r)]
    held = [(r, p) for r, p in files if is_held_out(r)]
    if not held and train:  # tiny smoke corpora: hold out the last file
        held, train = train[-1:], train[:-1]
    if not train:
        raise ValueError(f"corpus has no training files (root={root!r}, max_files={max_files})")
    source = f"CPython {sys.version.split()[0]} stdlib at {root or sysconfig.get_paths()['stdlib']}"
    return Corpus(
        _stream([p for _, p in train]),
        _stream([p for _, p in held]),
        tuple(r for r, _ in train),
        tuple(r for r, _ in held),
        source,
    )
