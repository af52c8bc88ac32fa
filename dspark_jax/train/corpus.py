"""The training corpus: the Python standard library sources of the running interpreter, plus
(optionally) the Python files of pinned packages that every install of the project has.

Download-free and deterministic: ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted
order, minus installed third-party packages and machine-specific / generated files; a held-out
split of whole files chosen by a hash of the relative path. Batches are windows of a pre-tokenized
stream (``[bos] file [eos] ...``).

Packages (``CorpusConfig.packages``) are read from the installed distributions, or from a zip
archive of the same files (``pack_packages``), and checked against ``corpus_packages.json``: every
package must have the pinned version and every file its recorded sha256, or the build fails.
Package files are named ``site-packages/<path>``; those the path hash puts in the held-out split,
and those whose text equals a held-out standard-library file, are kept out of training (the
held-out evaluation stays on the standard library's held-out files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import sysconfig
import tokenize
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

# Directories never read: third-party packages, bytecode, and a generated docs blob.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "pydoc_data")
# Machine-specific build data.
EXCLUDED_PREFIXES = ("_sysconfigdata",)
TEST_DIRS = ("test", "tests", "idle_test")
# The pinned packages: versions, file lists and sha256 of every *.py file (python -m dspark_jax.train.corpus).
MANIFEST = os.path.join(os.path.dirname(__file__), "corpus_packages.json")
PACKAGE_PREFIX = "site-packages/"


@dataclass(frozen=True)
class CorpusConfig:
    heldout_percent: float = 2.0  # share of files (by path hash) in the held-out split
    include_tests: bool = True  # the stdlib's own test suites (about half of its bytes)
    max_files: int | None = None  # keep only the first N files of the sorted list (toy runs)
    max_file_bytes: int = 400_000  # skip larger files (generated tables)
    root: str | None = None  # default: the running interpreter's stdlib
    packages: tuple[str, ...] = ()  # pinned packages (names in the manifest) added to the training split
    packages_archive: str | None = None  # read the package files from this zip instead of the installed ones
    manifest: str = MANIFEST

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
    packages: tuple[tuple[str, str], ...] = ()  # (name, version) of the pinned packages read
    excluded: tuple[str, ...] = ()  # package files kept out: held-out by path hash, or a held-out text

    def stats(self) -> dict:
        def nbytes(docs):
            return sum(len(t.encode("utf-8")) for _, t in docs)

        docs = self.train + self.heldout
        names = "\n".join(p for p, _ in docs)
        content = hashlib.sha256()
        for p, t in docs:
            content.update(f"{p}\n{hashlib.sha256(t.encode()).hexdigest()}\n".encode())
        package_docs = [d for d in self.train if d[0].startswith(PACKAGE_PREFIX)]
        return dict(root=self.root, train_files=len(self.train), heldout_files=len(self.heldout),
                    train_bytes=nbytes(self.train), heldout_bytes=nbytes(self.heldout),
                    skipped_files=len(self.skipped),
                    test_files=sum(is_test_path(p) for p, _ in docs),
                    packages=dict(self.packages), package_files=len(package_docs),
                    package_bytes=nbytes(package_docs), excluded_package_files=len(self.excluded),
                    file_list_sha256=hashlib.sha256(names.encode()).hexdigest(),
                    content_sha256=content.hexdigest())


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
    with open(path, "rb") as f:
        return decode_source(f.read())


def decode_source(data: bytes) -> str | None:
    """Text of Python source bytes decoded per its coding cookie (PEP 263); None if undecodable."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        with io.TextIOWrapper(io.BytesIO(data), encoding=encoding) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


# ---------------------------------------------------------------------------- pinned packages
MANIFEST_HINT = ("install the pinned versions, pass an archive of their files made on a machine that has "
                 "them (python -m dspark_jax.train.corpus pack OUT.zip), or train without packages")


class PackageMismatch(RuntimeError):
    """The installed (or archived) package files are not the pinned ones."""


def installed_files(name: str) -> tuple[str, dict[str, str]]:
    """Version and ``{site-packages relative path: absolute path}`` of the ``*.py`` files an
    installed distribution records."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise PackageMismatch(f"package {name!r} of the corpus is not installed") from None
    files = {}
    for f in dist.files or ():
        rel = str(f).replace(os.sep, "/")
        if rel.endswith(".py") and not rel.startswith("../") and "/__pycache__/" not in rel:
            files[rel] = str(dist.locate_file(f))
    return dist.version, files


def make_manifest(names: tuple[str, ...]) -> dict:
    """The manifest of installed packages: version and sha256 of every ``*.py`` file."""
    packages = {}
    for name in names:
        version, files = installed_files(name)
        hashes = {}
        for rel in sorted(files):
            with open(files[rel], "rb") as f:
                hashes[rel] = hashlib.sha256(f.read()).hexdigest()
        packages[name] = dict(version=version, files=hashes)
    return dict(packages=packages)


def load_manifest(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_packages(names: tuple[str, ...], manifest: dict, archive: str | None = None
                  ) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
    """Sorted ``(site-packages relative path, bytes)`` of the pinned packages' files and their
    ``(name, version)``; raises PackageMismatch unless versions and every sha256 match."""
    pinned = manifest["packages"]
    unknown = [n for n in names if n not in pinned]
    if unknown:
        raise PackageMismatch(f"packages {unknown} are not in the corpus manifest (pinned: {sorted(pinned)})")
    out, versions, problems = [], [], []
    zf = zipfile.ZipFile(archive) if archive is not None else None
    try:
        for name in names:
            pin = pinned[name]
            if zf is None:
                version, paths = installed_files(name)
                if version != pin["version"]:
                    problems.append(f"{name}: pinned {pin['version']}, installed {version}")
                    continue
                missing = sorted(set(pin["files"]) - set(paths))
            else:
                version, members = pin["version"], set(zf.namelist())
                missing = sorted(set(pin["files"]) - members)
            if missing:
                problems.append(f"{name} {version}: {len(missing)} pinned files missing, e.g. {missing[0]}")
                continue
            for rel in sorted(pin["files"]):
                if zf is None:
                    with open(paths[rel], "rb") as f:
                        data = f.read()
                else:
                    data = zf.read(rel)
                if hashlib.sha256(data).hexdigest() != pin["files"][rel]:
                    problems.append(f"{name} {version}: {rel} differs from its pinned sha256")
                    break
                out.append((rel, data))
            versions.append((name, version))
    finally:
        if zf is not None:
            zf.close()
    if problems:
        where = f"archive {archive}" if archive else "the installed packages"
        raise PackageMismatch(f"the corpus packages in {where} are not the pinned ones ({MANIFEST_HINT}):\n  "
                              + "\n  ".join(problems))
    return out, versions


def pack_packages(names: tuple[str, ...], out_zip: str, manifest_path: str = MANIFEST) -> int:
    """Write the pinned packages' files (checked against the manifest) into a zip; returns the file count."""
    files, _ = read_packages(names, load_manifest(manifest_path))
    Path(out_zip).parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out_zip, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in files:
            zf.writestr(zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return len(files)


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
    versions, excluded = [], []
    if cfg.packages:
        files, versions = read_packages(cfg.packages, load_manifest(cfg.manifest), cfg.packages_archive)
        held_texts = {t for _, t in heldout}
        for rel, data in files:
            name = PACKAGE_PREFIX + rel
            if not cfg.include_tests and is_test_path(rel):
                continue
            text = decode_source(data) if len(data) <= cfg.max_file_bytes else None
            if not text:
                skipped.append(name)
            elif is_heldout(name, cfg.heldout_percent) or text in held_texts:
                excluded.append(name)
            else:
                train.append((name, text))
    return Corpus(train=tuple(train), heldout=tuple(heldout), root=root, skipped=tuple(skipped),
                  packages=tuple(versions), excluded=tuple(excluded))


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


def main(argv: list[str] | None = None) -> int:
    """``python -m dspark_jax.train.corpus manifest NAME...`` rewrites the manifest from the installed
    packages; ``python -m dspark_jax.train.corpus pack OUT.zip`` archives the pinned packages' files."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dspark_jax.train.corpus")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="pin the installed versions of these packages")
    m.add_argument("names", nargs="+")
    k = sub.add_parser("pack", help="zip the pinned packages' files (checked against the manifest)")
    k.add_argument("out_zip")
    args = p.parse_args(argv)
    if args.cmd == "manifest":
        with open(MANIFEST, "w") as f:
            json.dump(make_manifest(tuple(args.names)), f, indent=0, sort_keys=True)
            f.write("\n")
        print(f"wrote {MANIFEST}")
    else:
        names = tuple(load_manifest(MANIFEST)["packages"])
        print(f"{pack_packages(names, args.out_zip)} files of {', '.join(names)} -> {args.out_zip}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
