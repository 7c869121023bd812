"""The session snapshot format: an .npz of state arrays plus a JSON `__meta__` record.

`Session.snapshot` / `Session.restore` in ds4/session.py decide what goes in; this module owns
the bytes: the reserved array names, the version, packing, unpacking and the checks a blob
must pass before a session loads it (docs/ARCHITECTURE.md, Snapshots).
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np

SNAPSHOT_VERSION = 1
META = "__meta__"
LOGITS = "__logits__"
FRONTIER_LOGITS = "__frontier_logits__"
FRONTIER_PREFIX = "frontier/"  # the rollback frontier's copies of the fixed-size arrays
REQUIRED_META = frozenset({"version", "fingerprint", "n", "tokens"})


def pack(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """The snapshot bytes of `arrays` (name -> host array) with `meta` as its JSON record."""
    arrays = dict(arrays)
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def unpack(blob: bytes) -> tuple[dict, dict]:
    """(arrays, meta) of a snapshot blob; ValueError when the bytes are not one."""
    try:
        with np.load(io.BytesIO(blob)) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(arrays.pop(META).tobytes())
        if not isinstance(meta, dict) or not REQUIRED_META <= meta.keys():
            raise ValueError("its metadata lacks version, fingerprint, n or tokens")
    except (OSError, EOFError, ValueError, KeyError, AttributeError, zipfile.BadZipFile) as err:
        raise ValueError(f"not a session snapshot ({err})") from None
    return arrays, meta


def check_compatible(meta: dict, fingerprint: dict) -> None:
    """ValueError unless a snapshot with `meta` was taken by an engine of this `fingerprint`."""
    if meta.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {meta.get('version')} is not supported")
    if meta["fingerprint"] != json.loads(json.dumps(fingerprint)):
        raise ValueError("snapshot was taken with a different model configuration")


def is_frontier_array(name: str) -> bool:
    """Whether array `name` is one of the rollback frontier's copies (not the live state)."""
    return name.startswith(FRONTIER_PREFIX) or name == FRONTIER_LOGITS
