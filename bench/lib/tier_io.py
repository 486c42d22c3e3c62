"""The store benchmark's measurements (``bench/store_bench.py``): each tier operation against raw I/O.

* :func:`bench_nvme_write`: ``LocalTier.write`` against a durable plain write of the same bytes
  (write + flush + fsync + close);
* :func:`bench_nvme_read`: ``LocalTier.read`` + ``read_snapshot`` + touching every payload byte
  against ``open(path, 'rb').read()`` (or ``readinto`` a reused, touched buffer) + the same touch,
  optionally after dropping the page cache (:func:`page_cache_dropper`);
* :func:`bench_s3_put` / :func:`bench_s3_get`: ``S3Tier.write`` / ``read`` against s3fs's
  ``pipe`` / ``cat`` of the same bytes.

Each returns the :class:`bench.lib.paired.Pair` of times from :func:`bench.lib.paired.alternate`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from bench.lib.paired import Pair, Timer, alternate
from bench.lib.store_snapshots import fresh_name, touch_bytes, touch_parts, uncached
from store.format.encode import EncodedSnapshot
from store.format.snapshot import read_snapshot
from store.tiers.local import LocalTier


def bench_nvme_write(timer: Timer, tier: LocalTier, rawdir: Path, snap: EncodedSnapshot, blob: bytes,
                     reps: int) -> Pair:
    def ours() -> float:
        name, data = fresh_name("w"), uncached(snap)
        t = timer.timed(lambda: tier.write(name, data, expires_at=snap.header.expires_at))
        if tier.path(name).stat().st_size != len(blob):
            raise AssertionError("the tier wrote a different number of bytes than the raw baseline")
        tier.delete(name)
        return t

    def raw() -> float:
        path = rawdir / f"raw-{os.urandom(6).hex()}.bin"

        def write() -> None:
            with open(path, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())

        t = timer.timed(write)
        path.unlink()
        return t

    return alternate(reps, ours, raw)


def read_ours(tier, name: str) -> None:
    snap = read_snapshot(tier.read(name), location=name)
    touch_parts(snap)
    snap.close()


def bench_nvme_read(timer: Timer, tier: LocalTier, name: str, reps: int, *, drop: Callable[[], None] | None = None,
                    readinto: bool = False) -> Pair:
    path = tier.path(name)
    reuse = bytearray(path.stat().st_size) if readinto else None
    if reuse is not None:
        reuse[:] = b"\1" * len(reuse)  # touched: its pages are resident

    def ours() -> float:
        return timer.timed(lambda: read_ours(tier, name), drop)

    def raw_read() -> None:
        with open(path, "rb") as f:
            data = f.read()
        touch_bytes(data)

    def raw_readinto() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(reuse)
        touch_bytes(reuse)

    def raw() -> float:
        return timer.timed(raw_readinto if readinto else raw_read, drop)

    return alternate(reps, ours, raw)


def page_cache_dropper() -> Callable[[], None] | None:
    """``echo 3 > /proc/sys/vm/drop_caches`` if this process may, else ``None``."""
    def drop() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    try:
        drop()
    except OSError:
        return None
    return drop


def bench_s3_put(timer: Timer, tier, fs, snap: EncodedSnapshot, blob: bytes, reps: int) -> Pair:
    def ours() -> float:
        name, data = fresh_name("p"), uncached(snap)
        t = timer.timed(lambda: tier.write(name, data, expires_at=snap.header.expires_at))
        tier.delete(name)
        return t

    def raw() -> float:
        path = f"{tier.bucket}/raw/{fresh_name('p')}"
        t = timer.timed(lambda: fs.pipe(path, blob))
        fs.rm(path)
        return t

    return alternate(reps, ours, raw)


def bench_s3_get(timer: Timer, tier, fs, name: str, reps: int) -> Pair:
    path = f"{tier.base}/{name}"

    def ours() -> float:
        return timer.timed(lambda: read_ours(tier, name))

    def raw() -> float:
        return timer.timed(lambda: touch_bytes(fs.cat(path)))

    return alternate(reps, ours, raw)
