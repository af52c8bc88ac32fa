"""Training data: stdlib file selection and split, byte-level BPE, window batches."""

import numpy as np
import pytest

from dspark_jax.train.corpus import (CorpusConfig, WindowSampler, build_corpus, is_heldout, is_test_path,
                                     list_sources, windows)
from dspark_jax.train.tokenizer import BOS, EOS, NOISE, PAD, encode_documents, special_ids, train_tokenizer


def _write(root, rel, text):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n",
        "json/decoder.py": "def decode(s):\n    return s\n",
        "json/__init__.py": "from .decoder import decode\n",
        "test/test_os.py": "def test_os():\n    assert True\n",
        "unittest/test/test_case.py": "x = 1\n",
        "site-packages/numpy/core.py": "third party\n",
        "__pycache__/os.cpython-312.py": "cached\n",
        "_sysconfigdata__linux.py": "build_time_vars = {}\n",
        "pydoc_data/topics.py": "topics = {}\n",
        "README.txt": "not python\n",
        "latin.py": "# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n",
        "empty.py": "",
    }
    for rel, text in files.items():
        enc = "latin-1" if rel == "latin.py" else "utf-8"
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding=enc)
    return tmp_path


def test_source_selection_is_sorted_and_skips_foreign_files(fake_stdlib):
    all_files = list_sources(str(fake_stdlib), include_tests=True)
    assert all_files == ["empty.py", "json/__init__.py", "json/decoder.py", "latin.py", "os.py",
                         "test/test_os.py", "unittest/test/test_case.py"]
    assert list_sources(str(fake_stdlib), include_tests=False) == [
        "empty.py", "json/__init__.py", "json/decoder.py", "latin.py", "os.py"]
    assert is_test_path("test/test_os.py") and is_test_path("ctypes/test_x.py")
    assert not is_test_path("unittest/case.py") and not is_test_path("contest.py")


def test_corpus_split_is_by_whole_file_and_deterministic(fake_stdlib):
    cfg = CorpusConfig(root=str(fake_stdlib), heldout_percent=30.0)
    a, b = build_corpus(cfg), build_corpus(cfg)
    assert a == b
    train, held = {p for p, _ in a.train}, {p for p, _ in a.heldout}
    assert train and held and not train & held
    assert train | held == set(list_sources(str(fake_stdlib), include_tests=True)) - {"empty.py"}
    assert a.skipped == ("empty.py",)
    assert held == {p for p in train | held if is_heldout(p, 30.0)}  # the split only depends on the path
    texts = dict(a.train + a.heldout)
    assert texts["latin.py"].endswith("name = 'caf\xe9'\n")  # decoded per its coding cookie
    assert a.stats()["file_list_sha256"] == b.stats()["file_list_sha256"]


def test_corpus_rejects_bad_config(tmp_path):
    with pytest.raises(ValueError, match="heldout_percent"):
        CorpusConfig(heldout_percent=0.0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_corpus(CorpusConfig(root=str(tmp_path / "missing")))
    _write(tmp_path, "only.py", "x = 1\n")
    with pytest.raises(ValueError, match="need both"):
        build_corpus(CorpusConfig(root=str(tmp_path)))


TEXTS = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n\n" * 3 for i in range(60)]


def test_tokenizer_is_deterministic_with_fixed_special_ids():
    a, b = train_tokenizer(TEXTS, 400), train_tokenizer(TEXTS, 400)
    assert a.to_str() == b.to_str()
    assert [special_ids(a)[t] for t in (BOS, EOS, NOISE, PAD)] == [0, 1, 2, 3]
    assert a.get_vocab_size() <= 400
    enc = a.encode(TEXTS[7])
    assert a.decode(enc.ids) == TEXTS[7]  # byte-level: lossless
    assert len(enc.ids) < len(TEXTS[7]) / 2  # merges were learned


def test_documents_are_framed_by_bos_and_eos():
    tok = train_tokenizer(TEXTS, 400)
    stream = encode_documents(tok, TEXTS[:3])
    assert stream.dtype == np.uint16
    starts, ends = np.flatnonzero(stream == 0), np.flatnonzero(stream == 1)
    assert starts.tolist() == [0, ends[0] + 1, ends[1] + 1] and ends[-1] == len(stream) - 1
    assert tok.decode(stream[1:ends[0]].tolist()) == TEXTS[0]
    assert not np.isin(stream, [2, 3]).any()
    with pytest.raises(ValueError, match="special token"):
        encode_documents(tok, ["x = '<|noise|>'\n"])
    with pytest.raises(ValueError, match="at least"):
        train_tokenizer(TEXTS, 100)


def test_window_sampler_visits_every_window_each_epoch():
    data = windows(np.arange(103), 10)
    assert data.shape == (10, 10) and data[3, 0] == 30
    s = WindowSampler(data, batch_size=3, seed=5)
    seen = np.concatenate([s.next()[:, 0] // 10 for _ in range(3)])
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 9  # no repeats within an epoch
    first_of_next = s.next()
    assert s.epoch == 1 and s.cursor == 3
    again = WindowSampler(data, batch_size=3, seed=5)
    again.seek(1, 0)
    np.testing.assert_array_equal(again.next(), first_of_next)  # resume lands on the same batch
    with pytest.raises(ValueError, match="exceeds"):
        WindowSampler(data, batch_size=11)
    with pytest.raises(ValueError, match="shorter"):
        windows(np.arange(5), 10)
