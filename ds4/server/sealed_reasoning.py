"""Responses `encrypted_content`: a turn's exact reasoning text, sealed for the client to keep.

Codex asks for `include: ["reasoning.encrypted_content"]` and sends each reasoning item back
on the next turn, often without its summary text. The sealed string lets the server render
that turn's reasoning byte for byte again, so the next prompt extends the tokens the slot
already holds. It is stateless: zlib'd UTF-8 text with an HMAC-SHA256 tag, under a key that
each server process draws at random when it starts. A value from another process (or one
that was changed) fails the tag and is ignored, as if the item carried none; after a restart
the reasoning of earlier turns is therefore lost, which costs a prefill, never an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import zlib

PREFIX = "ds4r1."  # format version: a later format can refuse this one by its prefix
TAG_BYTES = 32


class ReasoningSeal:
    """Seals reasoning text into an opaque string and opens such strings again."""

    def __init__(self, key: bytes | None = None):
        self.key = key or secrets.token_bytes(32)

    def seal(self, text: str) -> str:
        """The opaque `encrypted_content` of a reasoning text."""
        body = zlib.compress(text.encode("utf-8"))
        return PREFIX + base64.urlsafe_b64encode(self._tag(body) + body).decode("ascii")

    def open(self, sealed: object) -> str | None:
        """The reasoning text sealed in `sealed`; None for anything this process did not seal."""
        if not isinstance(sealed, str) or not sealed.startswith(PREFIX):
            return None
        payload = sealed[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(payload)
        except (ValueError, binascii.Error):
            return None
        if base64.urlsafe_b64encode(raw).decode("ascii") != payload:
            return None  # the decoder skips stray characters: only the form seal() writes
        tag, body = raw[:TAG_BYTES], raw[TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(body)):
            return None
        return zlib.decompress(body).decode("utf-8")  # authentic: it is what seal() wrote

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest()
