"""A prompt's tokens with the memory of tokenizing it bounded.

Tokenizing takes about 130 bytes of transient memory per character of text (the tokenizer's
normalized copies, offsets and token strings), and glibc keeps most of it in the worker
thread's arena afterwards: four 1 MB prompts at once grew the process by 545 MiB, of which
malloc_trim gave back all but 37 MiB (docs/OPERATIONS.md, "Memory under load"). So a text too
long for the context is refused from its length or from a prefix's tokens, large texts are
tokenized one at a time, and the heap is trimmed after each of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from ds4.server.errors import ApiError

LONGEST_TOKEN_CHARS = 128  # no V4 token spans more characters
PREFIX_CHARS_PER_TOKEN = 8  # twice what prose takes: a prefix this long shows an overflow
SPLIT_MARGIN = 64  # tokens a prefix's cut may add (a special token's text split in two)
LARGE_TEXT_CHARS = 256 * 1024
_large = threading.Semaphore(1)


def _malloc_trim():
    """glibc's malloc_trim, or None where there is none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()


def encode_prompt(tokenizer, text: str, limit: int | None = None,
                  param: str | None = None) -> list[int]:
    """Token ids of a prompt; with `limit`, a 400 for one that surely has more tokens, found
    without tokenizing the whole of a long text."""
    if len(text) < LARGE_TEXT_CHARS:
        return tokenizer.encode(text)
    with _large:
        try:
            if limit is not None:
                refuse_overflow(tokenizer, text, limit, param)
            return tokenizer.encode(text)
        finally:
            if _trim is not None:
                _trim(0)


def refuse_overflow(tokenizer, text: str, limit: int, param: str | None) -> None:
    """A 400 when the text's length, or its prefix's tokens, exceed `limit` tokens."""
    at_least = len(text) // LONGEST_TOKEN_CHARS
    prefix = limit * PREFIX_CHARS_PER_TOKEN
    if at_least <= limit and len(text) > prefix:
        at_least = len(tokenizer.encode(text[:prefix])) - SPLIT_MARGIN
    if at_least > limit:
        raise ApiError(400, f"Prompt has more than {at_least} tokens, but the configured "
                       f"context size is {limit} tokens", param=param,
                       code="context_length_exceeded",
                       extra={"n_prompt_tokens": at_least, "n_ctx": limit})
