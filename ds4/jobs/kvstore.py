"""Session checkpoints on disk: long prompts survive slot reuse and server restarts.

A checkpoint is one file `<sha256 of the token prefix>.kv` in the store's directory, laid out
as ds4/jobs/kvfile.py says (a header bound to the model's fingerprint, the prefix's token ids,
a `Session.snapshot()` payload). Checkpoints are taken at aligned token
frontiers (every `interval` tokens, so a prompt whose later part changed still finds its earlier
prefix) and at the end of every prompt. Files are written by a background thread (temp file +
rename) and evicted by a byte budget, old and rarely hit entries first. The directory is locked:
two servers never share one.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ds4.jobs.kvfile import (
    HEADER,
    TOUCH,
    TOUCH_AT,
    InvalidCheckpoint,
    checkpoint_name,
    decode_checkpoint,
    encode_checkpoint,
    read_header,
    token_bytes,
    without_frontier,
)

if TYPE_CHECKING:
    from ds4.engine import Engine
    from ds4.jobs.slot import Slot

log = logging.getLogger("ds4.kvstore")
HALF_LIFE_S = 6 * 3600.0  # a hit counts half as much for eviction after six hours
LOCK_NAME = "ds4-kvstore.lock"

class KVStore:
    """Checkpoint files of one directory under a byte budget; one writer thread."""

    def __init__(self, directory: str | Path, budget_bytes: int, interval: int = 2048,
                 min_tokens: int = 512):
        if interval < 1 or budget_bytes < 1:
            raise ValueError("the checkpoint interval and the disk budget must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock = DirectoryLock(self.directory)
        self.budget = budget_bytes
        self.interval = interval
        self.min_tokens = min_tokens
        self.fingerprint = b""
        self.stats = KVDiskStats()
        self.entries: dict[str, Entry] = {}
        self.pending: dict[str, tuple[list[int], bytes]] = {}  # queued, not yet on disk
        self._mutex = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=8)
        self._writer = threading.Thread(target=self._write_loop, name="ds4-kvstore", daemon=True)
        self._writer.start()

    # -- set-up and shutdown

    def use_model(self, fingerprint: bytes) -> None:
        """Index this model's checkpoints; others, and broken files, are removed."""
        self.fingerprint = fingerprint
        for path in sorted(self.directory.iterdir()):
            if ".kv.tmp." in path.name:  # a write that died with its process
                path.unlink(missing_ok=True)
            elif path.name.endswith(".kv"):
                self._index_file(path)
        with self._mutex:
            self._evict(protect=None)
        log.info("kv disk store %s: %d checkpoint(s), %.1f MiB", self.directory,
                 self.stats.files, self.stats.bytes / 2**20)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Finish queued writes, stop the writer, release the directory."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self.lock.release()

    # -- lookup and load (scheduler thread)

    def wants(self, n: int) -> bool:
        """True when a checkpoint of n tokens is long enough to keep."""
        return n >= self.min_tokens

    def holds(self, tokens: Sequence[int]) -> bool:
        """True when these exact tokens are stored or queued."""
        name = checkpoint_name(tokens)
        with self._mutex:
            return name in self.entries or name in self.pending

    def longest_prefix(self, prompt: Sequence[int], longer_than: int) -> tuple[int, str] | None:
        """(tokens, name) of the longest stored prefix of prompt longer than `longer_than`."""
        with self._mutex:
            by_name = {e.name: e.tokens for e in self.entries.values()}
            by_name.update({name: len(t) for name, (t, _) in self.pending.items()})
        counts = sorted({n for n in by_name.values() if longer_than < n <= len(prompt)})
        names = _prefix_names(prompt, counts)
        for n in reversed(counts):
            if by_name.get(names[n]) == n:
                return n, names[n]
        return None

    def load(self, name: str, prefix: Sequence[int]) -> bytes | None:
        """The payload of checkpoint `name` of `prefix`; None (file removed) when unusable."""
        with self._mutex:
            queued = self.pending.get(name)
        if queued is not None and queued[0] == list(prefix):
            return queued[1]
        path = self.directory / f"{name}.kv"
        try:
            _check_inside(path, self.directory)
            payload = decode_checkpoint(path.read_bytes(), self.fingerprint, prefix)
        except (OSError, InvalidCheckpoint) as err:
            self.discard(name, str(err))
            return None
        self._touch(name)
        return payload

    def discard(self, name: str, why: str) -> None:
        """Drop a checkpoint that cannot be used (one log line; the file is removed)."""
        log.warning("kv disk checkpoint %s skipped and removed: %s", name[:16], why)
        with self._mutex:
            self.pending.pop(name, None)
            entry = self.entries.pop(name, None)
            self._count_removed(entry)
        _unlink(self.directory / f"{name}.kv")

    def count_lookup(self, restored: int) -> None:
        """A begin asked the store: a hit restored `restored` tokens, 0 is a miss."""
        if restored:
            self.stats.hits += 1
            self.stats.restored_tokens += restored
        else:
            self.stats.misses += 1

    # -- store (scheduler thread queues, writer thread writes)

    def save(self, tokens: Sequence[int], payload: bytes, reason: str) -> None:
        """Queue a checkpoint of exactly `tokens` (the session's snapshot at that point)."""
        ids = list(tokens)
        name = checkpoint_name(ids)
        with self._mutex:
            if name in self.entries or name in self.pending:
                return
            self.pending[name] = (ids, payload)
        self._queue.put(("store", name, reason))

    # -- writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run(job)
            except Exception:  # a full disk or a bug must not stop later writes
                log.exception("kv disk store: %s failed", job[0])
            finally:
                self._queue.task_done()

    def _run(self, job: tuple) -> None:
        if job[0] == "store":
            self._write(job[1], job[2])
        else:
            self._write_touch(job[1])

    def _write(self, name: str, reason: str) -> None:
        with self._mutex:
            ids, payload = self.pending[name]
        data = encode_checkpoint(self.fingerprint, ids, without_frontier(payload), reason)
        if len(data) * 1.01 > self.budget:
            log.info("kv disk checkpoint of %d tokens (%d bytes) exceeds the budget; not stored",
                     len(ids), len(data))
        else:
            self._write_file(name, data)
            self._add(name, len(ids), len(data))
        with self._mutex:
            self.pending.pop(name, None)

    def _write_file(self, name: str, data: bytes) -> None:
        """Temp file + rename: a reader (or a crash) sees the whole file or none."""
        final = self.directory / f"{name}.kv"
        tmp = self.directory / f"{name}.kv.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)

    def _add(self, name: str, tokens: int, size: int) -> None:
        now = time.time()
        with self._mutex:
            self.entries[name] = Entry(name, tokens, size, 0, now, now)
            self.stats.stores += 1
            self.stats.bytes += size
            self.stats.files += 1
            self._evict(protect=name)

    def _touch(self, name: str) -> None:
        with self._mutex:
            entry = self.entries.get(name)
            if entry is None:
                return
            entry.hits += 1
            entry.last_used = time.time()
        self._queue.put(("touch", name))

    def _write_touch(self, name: str) -> None:
        """Persist hits and last_used in place (outside the checksum, so the file stays valid)."""
        with self._mutex:
            entry = self.entries.get(name)
        if entry is None:
            return
        try:
            fd = os.open(self.directory / f"{name}.kv", os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            os.pwrite(fd, TOUCH.pack(entry.last_used, entry.hits), TOUCH_AT)
        finally:
            os.close(fd)

    # -- index and eviction (callers hold the mutex where noted)

    def _index_file(self, path: Path) -> None:
        name = path.name[:-3]
        try:
            _check_inside(path, self.directory)
            with open(path, "rb") as f:
                raw = f.read(HEADER.size)
            fields = read_header(raw, self.fingerprint, path.stat().st_size)
        except (OSError, InvalidCheckpoint) as err:
            self.discard(name, str(err))
            return
        n, created, last_used, hits = fields[4], fields[6], fields[7], fields[8]
        size = path.stat().st_size
        with self._mutex:
            self.entries[name] = Entry(name, n, size, hits, last_used, created)
            self.stats.bytes += size
            self.stats.files += 1

    def _evict(self, protect: str | None) -> None:
        """Delete the lowest-scored entries while the store is over budget (mutex held)."""
        now = time.time()
        while self.stats.bytes > self.budget:
            victims = [e for e in self.entries.values() if e.name != protect]
            if not victims:
                return
            victim = min(victims, key=lambda e: (e.keep_score(now), e.last_used))
            self.entries.pop(victim.name)
            self.stats.bytes -= victim.size
            self.stats.files -= 1
            self.stats.evictions += 1
            _unlink(self.directory / f"{victim.name}.kv")

    def _count_removed(self, entry: Entry | None) -> None:
        self.stats.removed_invalid += 1
        if entry is not None:
            self.stats.bytes -= entry.size
            self.stats.files -= 1


class KVStoreBusy(RuntimeError):
    """Another server holds the checkpoint directory."""


@dataclass
class Entry:
    """One stored checkpoint as the index knows it."""

    name: str
    tokens: int
    size: int
    hits: int
    last_used: float
    created: float

    def keep_score(self, now: float) -> float:
        """Higher is kept longer: recent hits per byte, times the tokens it saves."""
        eff_hits = self.hits * 2.0 ** (-(now - self.last_used) / HALF_LIFE_S)
        eff_hits = 0.0 if eff_hits < 0.01 else eff_hits
        return (eff_hits + 1.0) * self.tokens / max(1, self.size)


# -- the store ---------------------------------------------------------------------------


@dataclass
class KVDiskStats:
    """Counters for /metrics (written by the scheduler and writer threads; plain ints)."""

    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    stores: int = 0
    evictions: int = 0
    removed_invalid: int = 0
    bytes: int = 0
    files: int = 0


class DirectoryLock:
    """An exclusive flock on the directory's lock file, held while the store is open."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise KVStoreBusy(f"--kv-disk-dir {directory} is in use by another ds4-server "
                              f"(pid {holder}); give each server its own directory") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Unlock (the file stays; the lock, not the file, says who owns the directory)."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def _prefix_names(prompt: Sequence[int], counts: list[int]) -> dict[int, str]:
    """checkpoint_name(prompt[:n]) for each n of the ascending counts, hashing once."""
    h = hashlib.sha256()
    names, done = {}, 0
    for n in counts:
        h.update(token_bytes(prompt[done:n]))
        names[n], done = h.copy().hexdigest(), n
    return names


def _check_inside(path: Path, directory: Path) -> None:
    """A link, or a name that leads out of the directory, is not a checkpoint we wrote."""
    if path.is_symlink() or path.resolve().parent != directory.resolve():
        raise InvalidCheckpoint("points outside the checkpoint directory")


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("kv disk store: cannot remove %s: %s", path, err)


# -- the store as one slot's job sees it -------------------------------------------------


class SlotCheckpoints:
    """Restore at `begin`, store at aligned frontiers and prompt ends, for one slot.

    The slot keeps its own continued-checkpoint frontier (`slot.kv_frontier`): aligned
    checkpoints up to it are already stored for the slot's timeline, so none is taken twice.
    """

    def __init__(self, store: KVStore, slot: Slot, engine: Engine):
        self.store = store
        self.slot = slot
        self.engine = engine

    def restore(self, prompt: Sequence[int], reuse: int) -> int:
        """Load the longest stored prefix longer than what the slot reuses; its token count.

        What the slot held beyond the reused part is about to be overwritten: it goes to disk
        first, so the conversation it belongs to can come back to it.
        """
        held = len(self.slot.session.tokens)
        if held > reuse:
            self._save(held, "evict", frontier=False)
        if len(prompt) <= reuse or not self.store.wants(len(prompt)):
            self.slot.kv_frontier = min(self.slot.kv_frontier, reuse)
            return 0
        restored = self._restore_longest(prompt, reuse)
        self.store.count_lookup(restored)
        self.slot.kv_frontier = restored or min(self.slot.kv_frontier, reuse)
        return restored

    def _restore_longest(self, prompt: Sequence[int], reuse: int) -> int:
        while True:  # a broken file is removed; the next shorter one may still serve
            found = self.store.longest_prefix(prompt, reuse)
            if found is None:
                return 0
            n, name = found
            payload = self.store.load(name, prompt[:n])
            if payload is not None and self._into_session(name, payload, prompt[:n]):
                return n

    def _into_session(self, name: str, payload: bytes, prefix: Sequence[int]) -> bool:
        session = self.slot.session
        try:
            session.restore(payload)
            if list(session.tokens) == list(prefix):
                return True
            why = "its snapshot holds other tokens"
        except Exception as err:  # the session may be half overwritten: start a clean one
            why = f"restore failed: {err}"
        self.slot.session = self.engine.new_session(session.ctx_size)
        self.store.discard(name, why)
        return False

    def next_stop(self, held: int, end: int) -> int:
        """Where the next prefill step should pause: the next aligned frontier, or the end."""
        aligned = (held // self.store.interval + 1) * self.store.interval
        return min(aligned, end)

    def reached(self, prompt: Sequence[int], n: int) -> None:
        """The session holds prompt[:n]: checkpoint an aligned frontier or the prompt's end."""
        if n == len(prompt) or n % self.store.interval == 0:
            self._save(n, "aligned" if n % self.store.interval == 0 else "prompt")

    def decoding(self) -> None:
        """Before a decode step: checkpoint a generated aligned frontier (long answers)."""
        n = len(self.slot.session.tokens)
        if n % self.store.interval == 0:
            self._save(n, "decode")

    def shutdown(self) -> None:
        """The server stops: keep what the slot holds."""
        self._save(len(self.slot.session.tokens), "shutdown", frontier=False)

    def _save(self, n: int, reason: str, frontier: bool = True) -> None:
        session = self.slot.session
        if n <= 0 or not self.store.wants(n) or (frontier and n <= self.slot.kv_frontier):
            return
        if frontier:
            self.slot.kv_frontier = n
        tokens = list(session.tokens)
        if len(tokens) != n or self.store.holds(tokens):
            return
        self.store.save(tokens, session.snapshot(), reason)
