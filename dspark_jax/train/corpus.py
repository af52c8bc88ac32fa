"""The training corpus: the Python standard library sources of the running interpreter.

Download-free and deterministic: ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted
order, minus installed third-party packages and machine-specific / generated files; a held-out
split of whole files chosen by a hash of the relative path. Batches are windows of a pre-tokenized
stream (``[bos] file [eos] ...``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

# Directories never read: third-party packages, bytecode, and a generated docs blob.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "pydoc_data")
# Machine-specific build data.
EXCLUDED_PREFIXES = ("_sysconfigdata",)
TEST_DIRS = ("test", "tests", "idle_test")


@dataclass(frozen=True)
class CorpusConfig:
    heldout_percent: float = 2.0  # share of files (by path hash) in the held-out split
    include_tests: bool = True  # the stdlib's own test suites (about half of its bytes)
    max_files: int | None = None  # keep only the first N files of the sorted list (toy runs)
    max_file_bytes: int = 400_000  # skip larger files (generated tables)
    root: str | None = None  # default: the running interpreter's stdlib

    def __post_init__(self):
        if not 0 < self.heldout_percent < 50:
            raise ValueError(f"heldout_percent must lie in (0, 50), got {self.heldout_percent}")
        if self.max_files is not None and self.max_files < 2:
            raise ValueError(f"max_files must be >= 2 (a train and a held-out file), got {self.max_files}")


@dataclass(frozen=True)
class Corpus:
    train: tuple[tuple[str, str], ...]  # (relative path, text)
    heldout: tuple[tuple[str, str], ...]
    root: str
    skipped: tuple[str, ...]  # files that could not be decoded or were too large

    def stats(self) -> dict:
        def nbytes(docs):
            return sum(len(t.encode("utf-8")) for _, t in docs)

        names = "\n".join(p for p, _ in self.train + self.heldout)
        return dict(root=self.root, train_files=len(self.train), heldout_files=len(self.heldout),
                    train_bytes=nbytes(self.train), heldout_bytes=nbytes(self.heldout),
                    skipped_files=len(self.skipped),
                    test_files=sum(is_test_path(p) for p, _ in self.train + self.heldout),
                    file_list_sha256=hashlib.sha256(names.encode()).hexdigest())


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_test_path(rel: str) -> bool:
    parts = Path(rel).parts
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def list_sources(root: str, *, include_tests: bool) -> list[str]:
    """Sorted relative paths of the ``*.py`` files to use."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py") or name.startswith(EXCLUDED_PREFIXES):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if include_tests or not is_test_path(rel):
                out.append(rel)
    return sorted(out)


def is_heldout(rel: str, percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h % 10_000 < round(percent * 100)


def read_source(path: str) -> str | None:
    """Text of a Python file decoded per its coding cookie (PEP 263); None if undecodable."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def build_corpus(cfg: CorpusConfig) -> Corpus:
    root = cfg.root or stdlib_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory {root!r} does not exist")
    files = list_sources(root, include_tests=cfg.include_tests)
    if cfg.max_files is not None:
        files = files[:cfg.max_files]
    train, heldout, skipped = [], [], []
    for rel in files:
        path = os.path.join(root, rel)
        text = read_source(path) if os.path.getsize(path) <= cfg.max_file_bytes else None
        if not text:
            skipped.append(rel)
            continue
        (heldout if is_heldout(rel, cfg.heldout_percent) else train).append((rel, text))
    if not heldout and len(train) >= 2:  # tiny corpora: always keep one held-out file
        heldout.append(train.pop())
    if not train or not heldout:
        raise ValueError(f"corpus at {root} has {len(train)} train / {len(heldout)} held-out files; need both")
    return Corpus(train=tuple(train), heldout=tuple(heldout), root=root, skipped=tuple(skipped))


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows [n, seq_len] of a token stream (the tail shorter than a window is dropped)."""
    n = len(stream) // seq_len
    if n < 1:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window of {seq_len}")
    return np.asarray(stream[:n * seq_len]).reshape(n, seq_len)


@dataclasses.dataclass
class WindowSampler:
    """Batches of windows: every epoch visits all windows once in a fresh seeded order."""

    data: np.ndarray  # [n, seq_len]
    batch_size: int
    seed: int = 0
    epoch: int = 0
    cursor: int = 0

    def __post_init__(self):
        if self.batch_size > len(self.data):
            raise ValueError(f"batch_size {self.batch_size} exceeds the {len(self.data)} available windows")
        self._order = self._perm(self.epoch)

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.data))

    def seek(self, epoch: int, cursor: int) -> None:
        """Continue from a saved position (resumed runs)."""
        self.epoch, self.cursor = epoch, cursor
        self._order = self._perm(epoch)

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.cursor / len(self.data)

    def next(self) -> np.ndarray:
        if self.cursor + self.batch_size > len(self.data):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        idx = self._order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.data[idx].astype(np.int32)

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.next()
