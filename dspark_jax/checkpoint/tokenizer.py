"""Tokenizer loading and the DeepSeek-V4 chat encoding.

DeepSeek-V4 ships a Python chat encoder (``encoding/encoding_dsv4.py``) instead of a template.
The part implemented here covers system / user / assistant turns in chat and thinking mode:

    BOS [system text] <｜User｜>{user}<｜Assistant｜>{"<think>" | "</think>"} ...

- After a user turn that is followed by an assistant turn (or ends the conversation), the
  encoder writes ``<｜Assistant｜>`` and then ``<think>`` in thinking mode or ``</think>`` in chat
  mode. With ``drop_thinking`` (the default) earlier turns are rendered as in chat mode
  (``</think>``) and their reasoning is dropped; only turns after the last user message keep it.
- An assistant turn is ``[reasoning + "</think>"] content`` followed by EOS; the reasoning part
  appears only in thinking mode for turns that keep it.
- Consecutive user turns are concatenated without an assistant marker between them.

Not covered: tools / DSML tool calls, tool results, task tokens, ``latest_reminder`` and
``reasoning_effort`` prompts. Special-token ids are looked up in the tokenizer; ``encode_chat``
encodes each text piece separately, so special-token strings typed inside message content stay
plain text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from dspark_jax.checkpoint.files import CheckpointFileError, read_json

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
ROLES = ("system", "user", "assistant")


class ChatFormatError(ValueError):
    """Messages that the chat encoding cannot represent."""


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` (a file or a checkpoint directory), or
    None when a checkpoint directory has no tokenizer. A malformed file raises
    ``CheckpointFileError`` naming it."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            return None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception ("Model missing", ...)
        read_json(path)  # malformed JSON: say so
        raise CheckpointFileError(f"{path}: not a tokenizer file of the tokenizers library ({e})") from None


def has_chat_tokens(tokenizer) -> bool:
    """Whether the tokenizer has the DeepSeek-V4 chat special tokens (the official checkpoints'
    has them; the shipped tiny model, trained on plain code, has not)."""
    return all(tokenizer.token_to_id(t) is not None for t in SPECIAL_TOKENS)


@dataclass(frozen=True)
class ChatTokens:
    """Ids of the chat special tokens in one tokenizer."""

    bos: int
    eos: int
    user: int
    assistant: int
    think_start: int
    think_end: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatTokens":
        ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ChatFormatError(f"the tokenizer lacks the DeepSeek-V4 chat tokens {missing}")
        return cls(*(ids[t] for t in SPECIAL_TOKENS))


def _check(messages: Sequence[Mapping]) -> None:
    if not messages:
        raise ChatFormatError("no messages")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in ROLES:
            raise ChatFormatError(f"message {i}: role must be one of {ROLES}, got {role!r}")
        if not isinstance(m.get("content", ""), str):
            raise ChatFormatError(f"message {i}: content must be a string")
        if role == "system" and i != 0:
            raise ChatFormatError(f"message {i}: a system message may only come first")
        if role != "assistant" and m.get("reasoning_content"):
            raise ChatFormatError(f"message {i}: only assistant messages carry reasoning_content")


def chat_pieces(messages: Sequence[Mapping], thinking: bool = False, *, drop_thinking: bool = True
                ) -> list[tuple[str, bool]]:
    """The chat encoding as (text, is_special_token) pieces, in order."""
    _check(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out: list[tuple[str, bool]] = [(BOS, True)]

    def text(s: str):
        if s:
            out.append((s, False))

    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            text(content)
        elif role == "user":
            out.append((USER, True))
            text(content)
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
            if nxt in (None, "assistant"):
                out.append((ASSISTANT, True))
                keep = thinking and (not drop_thinking or i >= last_user)
                out.append((THINK_START if keep else THINK_END, True))
        else:
            if i == 0 or messages[i - 1]["role"] != "user":
                raise ChatFormatError(f"message {i}: an assistant turn must follow a user turn")
            if thinking and (not drop_thinking or i > last_user):
                text(m.get("reasoning_content") or "")
                out.append((THINK_END, True))
            text(content)
            out.append((EOS, True))
    return out


def chat_text(messages: Sequence[Mapping], thinking: bool = False, *, drop_thinking: bool = True) -> str:
    """The chat encoding as a string (what the official encoder produces for these messages)."""
    return "".join(t for t, _ in chat_pieces(messages, thinking, drop_thinking=drop_thinking))


def encode_chat(messages: Sequence[Mapping], thinking: bool = False, *, tokenizer, drop_thinking: bool = True
                ) -> list[int]:
    """Token ids of a conversation, ready for generation when it ends with a user turn.

    messages: dicts with ``role`` ("system" first if any, then "user" / "assistant"),
    ``content`` and, for assistant turns, optional ``reasoning_content``. thinking: thinking
    mode (the reply starts with ``<think>``) or chat mode (``</think>``).
    """
    special = ChatTokens.from_tokenizer(tokenizer)
    by_text = {BOS: special.bos, EOS: special.eos, USER: special.user, ASSISTANT: special.assistant,
               THINK_START: special.think_start, THINK_END: special.think_end}
    pieces = chat_pieces(messages, thinking, drop_thinking=drop_thinking)
    ids: list[int] = []
    as_text = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True  # special-token strings inside message text stay text
    try:
        for piece, is_special in pieces:
            if is_special:
                ids.append(by_text[piece])
            else:
                ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    finally:
        tokenizer.encode_special_tokens = as_text
    return ids
