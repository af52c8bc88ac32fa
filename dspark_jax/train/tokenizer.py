"""Byte-level BPE tokenizer trained with the ``tokenizers`` library.

Special tokens take the first ids, in this order: ``<|bos|>`` = 0, ``<|eos|>`` = 1 (the official
DeepSeek-V4 ids), ``<|noise|>`` = 2 (the DSpark mask token filling draft blocks), ``<|pad|>`` = 3.
A document is encoded as ``[bos] + tokens + [eos]``; no post-processor adds them implicitly.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, NOISE, PAD = "<|bos|>", "<|eos|>", "<|noise|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, NOISE, PAD)
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (specials and 256 bytes included).

    Deterministic for a given sequence of texts."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (specials + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    ids = special_ids(tok)
    if [ids[t] for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens did not receive the first ids: {ids}")
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    out = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is None:
            raise ValueError(f"tokenizer lacks the special token {t}")
        out[t] = i
    return out


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """One stream ``[bos] doc_0 [eos] [bos] doc_1 [eos] ...`` as uint16 (int32 if the vocab needs it)."""
    ids = special_ids(tok)
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    parts = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        doc = np.asarray(enc.ids, dtype=dtype)
        if np.any(doc < len(SPECIAL_TOKENS)):
            raise ValueError("a document contains the text of a special token; remove it from the corpus")
        parts += [np.array([ids[BOS]], dtype), doc, np.array([ids[EOS]], dtype)]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)
