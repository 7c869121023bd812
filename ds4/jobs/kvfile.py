"""The checkpoint file of ds4/jobs/kvstore.py: its layout, the model fingerprint it is bound
to, and the checks a file must pass before its payload is trusted.

A file is a fixed header (magic, format version, the reason it was written, the model's
fingerprint, token count, payload size, created / last-used times, hits and a sha256 over the
token ids and the payload), the prefix's token ids (uint32), then the payload: a
`Session.snapshot()` without its rollback-frontier copies.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ds4.snapshot import is_frontier_array, pack, unpack

if TYPE_CHECKING:
    from ds4.engine import Engine

FORMAT_VERSION = 1
MAGIC = b"DS4KVCK\0"
# magic, version, reason, fingerprint, tokens, payload bytes, created, last_used, hits, reserved,
# sha256 of (token ids + payload)
HEADER = struct.Struct("<8sHH32sQQddII32s")
TOUCH_AT = struct.calcsize("<8sHH32sQQd")  # offset of last_used, hits (rewritten on a hit)
TOUCH = struct.Struct("<dI")
REASONS = {"aligned": 1, "prompt": 2, "decode": 3, "evict": 4, "shutdown": 5}
SAMPLES_PER_FILE = 16  # weight bytes sampled per safetensors file for the fingerprint


class InvalidCheckpoint(ValueError):
    """A checkpoint file that cannot be used (corrupt, truncated, foreign or misplaced)."""


# -- model fingerprint -------------------------------------------------------------------


def model_fingerprint(engine: Engine) -> bytes:
    """sha256 of config.json, the engine's shape fingerprint and a digest of the weight files."""
    h = hashlib.sha256()
    model_dir = Path(engine.model_dir)
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    h.update(json.dumps(engine.fingerprint(), sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(weights_digest(path))
    return h.digest()


def weights_digest(path: Path) -> bytes:
    """sha256 of a safetensors file's header (names, dtypes, shapes), its size and a few samples."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(f.read(min(header_len, size)))
        for k in range(SAMPLES_PER_FILE):  # values: the same shapes with other weights differ
            f.seek(8 + header_len + (size - 8 - header_len) * k // SAMPLES_PER_FILE)
            h.update(f.read(64))
    return h.digest()


# -- file format -------------------------------------------------------------------------


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 (what names and files hold)."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def checkpoint_name(tokens: Sequence[int]) -> str:
    """The file stem of the checkpoint of exactly these tokens."""
    return hashlib.sha256(token_bytes(tokens)).hexdigest()


def without_frontier(snapshot: bytes) -> bytes:
    """A Session.snapshot() minus its rollback-frontier copies (fixed arrays, logits).

    A restored session takes its frontier at the restored point anyway, so on disk the copies
    only cost bytes: at Flash dimensions about 23 MB a file, half of a 2048-token checkpoint.
    """
    try:
        arrays, meta = unpack(snapshot)
    except ValueError:
        return snapshot  # not a snapshot: stored as given (restore will refuse it)
    meta.pop("frontier", None)
    return pack(meta, {k: v for k, v in arrays.items() if not is_frontier_array(k)})


def encode_checkpoint(fingerprint: bytes, tokens: Sequence[int], payload: bytes,
                      reason: str) -> bytes:
    """Header + token ids + payload, as one file's bytes."""
    ids = token_bytes(tokens)
    now = time.time()
    digest = hashlib.sha256(ids + payload).digest()
    header = HEADER.pack(MAGIC, FORMAT_VERSION, REASONS[reason], fingerprint, len(tokens),
                         len(payload), now, now, 0, 0, digest)
    return header + ids + payload


def read_header(raw: bytes, fingerprint: bytes, file_size: int) -> tuple:
    """The header's fields; InvalidCheckpoint when it is not one of this model's checkpoints."""
    if len(raw) < HEADER.size:
        raise InvalidCheckpoint("truncated header")
    fields = HEADER.unpack(raw[: HEADER.size])
    magic, version, _, fp, n, payload_len = fields[:6]
    if magic != MAGIC:
        raise InvalidCheckpoint("not a ds4 checkpoint")
    if version != FORMAT_VERSION:
        raise InvalidCheckpoint(f"format version {version}, expected {FORMAT_VERSION}")
    if fp != fingerprint:
        raise InvalidCheckpoint("written by another model")
    if HEADER.size + 4 * n + payload_len != file_size:
        raise InvalidCheckpoint(f"size {file_size} does not match its header (truncated?)")
    return fields


def decode_checkpoint(raw: bytes, fingerprint: bytes, expect: Sequence[int]) -> bytes:
    """The payload of a checkpoint of exactly `expect`; InvalidCheckpoint otherwise."""
    fields = read_header(raw, fingerprint, len(raw))
    n, digest = fields[4], fields[10]
    body = memoryview(raw)[HEADER.size:]
    if hashlib.sha256(body).digest() != digest:
        raise InvalidCheckpoint("checksum mismatch")
    if n != len(expect) or bytes(body[: 4 * n]) != token_bytes(expect):
        raise InvalidCheckpoint("holds other tokens than its name says")
    return bytes(body[4 * n:])
