"""Disk KV store files: the budget holds (old, rarely hit entries go first), broken, foreign
or misplaced checkpoints are skipped and removed while the request still succeeds, and two
servers never share one directory."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_kvstore import (  # noqa: F401  (cold: the reference server fixture)
    INTERVAL,
    KV,
    aligned_common,
    cached,
    cold,
    complete,
    long_text,
    metric,
)
from test_server_support import free_port, live_server

from ds4.jobs.kvfile import FORMAT_VERSION, HEADER, InvalidCheckpoint, decode_checkpoint
from ds4.jobs.kvstore import KVStore, KVStoreBusy

FINGERPRINT = bytes(range(32))
FP_AT = struct.calcsize("<8sHH")  # where the model fingerprint sits in a header


def header_tokens(path: Path) -> int:
    return HEADER.unpack(path.read_bytes()[: HEADER.size])[4]


def file_tokens(raw: bytes) -> list[int]:
    n = HEADER.unpack(raw[: HEADER.size])[4]
    return list(struct.unpack(f"<{n}I", raw[HEADER.size: HEADER.size + 4 * n]))


def valid(path: Path, fingerprint: bytes) -> bool:
    raw = path.read_bytes()
    try:
        decode_checkpoint(raw, fingerprint, file_tokens(raw))
    except (InvalidCheckpoint, struct.error):
        return False
    return True


def kv_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"), key=header_tokens)


def test_the_store_stays_within_its_budget(tmp_path):
    with live_server(kv_disk_dir=str(tmp_path), kv_disk_space_mb=3, **KV) as (url, runtime):
        for seed in (20, 21):
            complete(url, long_text(seed), max_tokens=1)
        runtime.kvstore.flush()
        sizes = [p.stat().st_size for p in tmp_path.glob("*.kv")]
        assert 0 < sum(sizes) <= 3 * 2**20
        assert metric(url, "ds4_kv_disk_bytes") == sum(sizes)
        assert metric(url, "ds4_kv_disk_evictions_total") > 0
        assert not list(tmp_path.glob("*.tmp.*"))


def test_eviction_prefers_old_and_rarely_hit_entries(tmp_path):
    store = KVStore(tmp_path, budget_bytes=25_000, interval=4, min_tokens=4)
    try:
        store.use_model(FINGERPRINT)
        prefixes = [list(range(k, k + 8)) for k in range(3)]
        for ids in prefixes[:2]:
            store.save(ids, b"p" * 9000, "aligned")
        store.flush()
        hit = store.longest_prefix(prefixes[0] + [99], 0)
        assert hit is not None and store.load(hit[1], prefixes[0]) == b"p" * 9000
        store.save(prefixes[2], b"q" * 9000, "aligned")  # over budget: one of the others goes
        store.flush()
        assert store.longest_prefix(prefixes[0], 0) is not None  # hit once: kept
        assert store.longest_prefix(prefixes[1], 0) is None  # never hit: evicted
        assert store.longest_prefix(prefixes[2], 0) is not None  # just written: kept
        assert store.stats.evictions == 1
        store.save(list(range(50, 90)), b"r" * 40_000, "aligned")  # alone above the budget
        store.flush()
        assert store.stats.files == 2
    finally:
        store.close()
    reopened = KVStore(tmp_path, budget_bytes=25_000)  # hits survive a restart
    try:
        reopened.use_model(FINGERPRINT)
        assert {e.hits for e in reopened.entries.values()} == {0, 1}
    finally:
        reopened.close()


def corrupt(files: list[Path], outside: Path) -> None:
    """Flip a payload byte, truncate, another model, another version; a link outside."""
    raw = bytearray(files[0].read_bytes())
    raw[-100] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    with open(files[1], "r+b") as f:
        f.truncate(files[1].stat().st_size - 1000)
    raw = bytearray(files[2].read_bytes())
    raw[FP_AT: FP_AT + 32] = bytes(32)
    files[2].write_bytes(bytes(raw))
    raw = bytearray(files[3].read_bytes())
    raw[8:10] = struct.pack("<H", FORMAT_VERSION + 1)
    files[3].write_bytes(bytes(raw))
    outside.write_bytes(files[4].read_bytes())
    files[4].unlink()
    os.symlink(outside, files[4])


def test_broken_foreign_or_outside_checkpoints_are_removed_and_the_request_succeeds(
        tmp_path, cold, caplog):  # noqa: F811  (cold: the imported fixture)
    store_dir, outside = tmp_path / "kv", tmp_path / "elsewhere.kv"
    prompt = long_text(30, 120)
    grown = prompt[:-8] + " with an ending"  # not an extension: the whole-prompt file misses
    with live_server(kv_disk_dir=str(store_dir), **KV) as (url, runtime):
        complete(url, prompt, max_tokens=1)
        expect = aligned_common(runtime, prompt, grown)
    aligned = [p for p in kv_files(store_dir) if header_tokens(p) % INTERVAL == 0]
    usable = [p for p in aligned if header_tokens(p) <= expect]
    assert len(usable) >= 6
    corrupt(usable[::-1][:5], outside)  # the five longest usable ones
    caplog.set_level(logging.WARNING, logger="ds4.kvstore")
    with live_server(kv_disk_dir=str(store_dir), **KV) as (url, runtime):
        reply = complete(url, grown)
        assert cached(reply) == expect - 5 * INTERVAL  # the longest intact frontier
        assert metric(url, "ds4_kv_disk_removed_invalid_total") == 5
        runtime.kvstore.flush()
        fingerprint = runtime.kvstore.fingerprint
        assert all(valid(p, fingerprint) for p in store_dir.glob("*.kv"))
        assert not any(p.is_symlink() for p in store_dir.iterdir())
    assert outside.is_file()  # a link is removed, never what it points to
    skipped = [r for r in caplog.records if "skipped and removed" in r.getMessage()]
    assert len(skipped) == 5  # one line per file
    assert reply["choices"][0]["text"] == complete(cold[0], grown)["choices"][0]["text"]


def test_a_second_store_on_the_same_directory_is_refused(tmp_path):
    first = KVStore(tmp_path, budget_bytes=2**20)
    try:
        with pytest.raises(KVStoreBusy, match=f"in use by another ds4-server .pid {os.getpid()}"):
            KVStore(tmp_path, budget_bytes=2**20)
        with live_server(load=False, kv_disk_dir=str(tmp_path)) as (url, runtime):
            assert not runtime.load()
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "in use by another" in health.json()["error"]
    finally:
        first.close()
    KVStore(tmp_path, budget_bytes=2**20).close()  # released: the directory is free again


def test_ds4_server_refuses_a_directory_in_use(tmp_path):
    held = KVStore(tmp_path, budget_bytes=2**20)
    try:
        run = subprocess.run([sys.executable, "-m", "ds4.cli.server", "--kv-disk-dir",
                              str(tmp_path), "--port", str(free_port())],
                             capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    assert run.returncode == 2
    assert "in use by another ds4-server" in run.stderr


def test_disk_flags_default_to_4096_mib_and_stay_off_without_a_directory(tmp_path):
    from ds4.cli.server import config_from

    assert config_from([]).kv_disk_dir is None
    cfg = config_from(["--kv-disk-dir", str(tmp_path)])
    assert (cfg.kv_disk_dir, cfg.kv_disk_space_mb, cfg.kv_disk_interval) == (str(tmp_path),
                                                                             4096, 2048)
    cfg = config_from(["--kv-disk-dir", str(tmp_path), "--kv-disk-space-mb", "64",
                       "--kv-disk-interval", "256"])
    assert (cfg.kv_disk_space_mb, cfg.kv_disk_interval) == (64, 256)
