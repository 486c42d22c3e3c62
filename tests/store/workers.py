"""Child-process bodies for the multi-process store tests (crash, concurrency).

Run as ``python -m tests.store.workers <command> '<json config>'`` with the repository
root as the working directory (the tests start them with ``sys.executable`` and
``cwd=REPO``). Every command reports through files named in its config, never through
return values, so a parent can judge a child it killed.

Commands:
    zygote      imports everything once, builds a pool of snapshots, then forks writer
                children on request (``fork <start> <variant>`` on stdin, answers
                ``pid <pid>`` once the child has begun its first write) and reaps them
                (``reap <pid>``, answers ``status <pid> <raw wait status>``). The parent
                SIGKILLs the writers: forking from a warm process makes a kill round cost
                milliseconds instead of a fresh interpreter importing torch.
    reader      on ``pass`` (stdin), reads every visible snapshot once (raw
                ``read_snapshot`` and ``Store.get``) and answers its running counts as
                one JSON line; on ``quit``, writes its results and exits. The parent asks
                for a pass while a writer is alive, so every pass races a write.
    same_keys   writes and reads the same chain of keys as its siblings.
    diff_keys   writes its own keys under a small cap, sampling the index's usage.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import xxhash

from store.errors import SnapshotError, StoreFull
from store.format.encode import EncodedSnapshot, snapshot_bytes
from store.format.snapshot import read_snapshot
from store.tiers.base import parse_object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

REPO = Path(__file__).resolve().parents[2]
# Shapes of the crash pool: 8 kv heads x 128 head dim x 16 tokens is 16 KiB per layer
# and K/V, so these give files of ~70 KiB, ~270 KiB and ~1 MiB (a few ms to write+fsync).
CRASH_LAYERS = (2, 8, 32)
CRASH_HEADS = 8
CRASH_HEAD_DIM = 128


def command(cmd: str, cfg: dict) -> list[str]:
    """argv that runs ``cmd`` with ``cfg`` in a fresh interpreter (cwd must be REPO)."""
    return [sys.executable, "-m", "tests.store.workers", cmd, json.dumps(cfg)]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _touch(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


def _wait_for(path: str, timeout: float = 300.0) -> None:  # a hang guard
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.part"
    Path(tmp).write_text(json.dumps(obj))
    os.replace(tmp, path)


def _store(cfg: dict) -> tuple[Store, LocalTier]:
    tier = LocalTier(cfg["root"], cap_bytes=cfg["cap"], recency_flush_s=cfg.get("recency_flush_s", 0.05))
    return Store([tier]), tier


def crash_layers(seed: int, n: int) -> list[int]:
    """Layer count of each snapshot in the crash pool (deterministic, shared by parent and children)."""
    rng = random.Random(seed)
    return [rng.choice(CRASH_LAYERS) for _ in range(n)]


def _variant(snap: EncodedSnapshot, v: int) -> EncodedSnapshot:
    """The same KV written at another time: a header of a different length (so the file
    size of a key differs between its variants), same payload."""
    created = 1_700_000_000.5 if v == 0 else 1_700_000_000.123456789
    ttl = snap.header.expires_at - snap.header.created_at
    return EncodedSnapshot(replace(snap.header, created_at=created, expires_at=created + ttl), snap.payload)


# -- zygote: forks writers that the parent kills ------------------------------------
def zygote(cfg: dict) -> None:
    torch.set_num_threads(1)
    root = make_root()
    n = cfg["n"]
    chain = make_chain(root, n)
    layers = crash_layers(cfg["seed"], n)
    pool: list[tuple[EncodedSnapshot, EncodedSnapshot]] = []
    manifest = []
    for i, (block, nl) in enumerate(zip(chain, layers)):
        base = make_snapshot(root, block, layers=nl, heads=CRASH_HEADS, head_dim=CRASH_HEAD_DIM, seed=i,
                             ttl_s=cfg.get("ttl_s", 10 * 365 * 86400))
        variants = (_variant(base, 0), _variant(base, 1))
        pool.append(variants)
        manifest.append({"key": block.key,
                         "xxh3": [xxhash.xxh3_64_hexdigest(snapshot_bytes(v)) for v in variants]})
    _write_json(cfg["manifest"], {"entries": manifest})
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "fork":
            start, variant = int(parts[1]), int(parts[2])
            began_r, began_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(began_r)
                _crash_writer(cfg, pool, start, variant, began_w)  # never returns
            os.close(began_w)
            os.read(began_r, 1)  # the child's first write has begun (or it died: end of file)
            os.close(began_r)
            out.write(f"pid {pid}\n")
            out.flush()
        elif parts[0] == "reap":
            pid = int(parts[1])
            _, status = os.waitpid(pid, 0)
            out.write(f"status {pid} {status}\n")
            out.flush()
        elif parts[0] == "quit":
            break


def _crash_writer(cfg: dict, pool: list, start: int, variant: int, began_fd: int) -> None:
    """Forked child: write snapshots ``pool[start:]`` (then round again) until killed.
    Logs ``B``egin and ``E``nd of each write (O_APPEND, unbuffered) so the parent knows
    where it died; writes one byte to ``began_fd`` when the first write begins."""
    pid = os.getpid()
    code = 0
    fd = os.open(cfg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        store, _ = _store(cfg)
        i = start
        while True:  # round the pool again when at its end: evicted keys are written anew
            i %= len(pool)
            os.write(fd, f"B {pid} {i}\n".encode())
            if began_fd >= 0:
                os.write(began_fd, b"B")
                os.close(began_fd)
                began_fd = -1
            wrote = store.put(ACME, pool[i][variant])
            os.write(fd, f"E {pid} {i} {int(wrote)}\n".encode())
            i += 1
    except BaseException:
        msg = traceback.format_exc().replace("\n", " | ")
        os.write(fd, f"X {pid} {msg}\n".encode())
        code = 1
    os._exit(code)


# -- reader: reads everything visible while writers are being killed ------------------
def reader(cfg: dict) -> None:
    root = make_root()
    chain = make_chain(root, cfg["n"])
    by_key = {b.key: b for b in chain}
    store, tier = _store(cfg)
    result = {"raw_reads": 0, "gets": 0, "hits": 0, "vanished": 0, "corrupt": [], "errors": [], "passes": 0,
              "max_index": 0}
    rng = random.Random(cfg.get("seed", 0))
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        # one SELECT: an exact, atomic figure even while writers work (a directory walk is not)
        result["max_index"] = max(result["max_index"], tier.usage())
        for entry in list(tier.entries("acme/")):
            mm = tier.read(entry.name)
            if mm is None:
                result["vanished"] += 1  # evicted between listing and reading: a miss
                continue
            try:
                snap = read_snapshot(mm, location=entry.name)
                _, key = parse_object_name(entry.name)
                if snap.header.key != key:
                    result["errors"].append(f"{entry.name} holds {snap.header.key}")
                snap.close()
                result["raw_reads"] += 1
            except SnapshotError as exc:
                result["corrupt"].append(f"{entry.name}: {exc}")
            except Exception:  # anything else is a bug of its own
                result["errors"].append(traceback.format_exc())
            del mm  # the mapping goes with its last view
        for block in rng.sample(chain, min(8, len(chain))):
            try:
                result["gets"] += 1
                snap = store.get(ACME, block, root)
                if snap is not None:
                    result["hits"] += 1
                    if snap.header.key != by_key[block.key].key:
                        result["errors"].append(f"get({block.key}) returned {snap.header.key}")
                    snap.close()
            except SnapshotError as exc:
                result["corrupt"].append(f"get {block.key}: {exc}")
            except Exception:
                result["errors"].append(traceback.format_exc())
        result["passes"] += 1
        out.write(json.dumps({k: result[k] for k in ("passes", "raw_reads", "hits")}) + "\n")
        out.flush()
    result["stats"] = store.stats.as_dict()
    store.close()
    _write_json(cfg["out"], result)


# -- concurrency: same keys from every process ----------------------------------------
def same_keys(cfg: dict) -> None:
    torch.set_num_threads(1)
    wid = cfg["worker"]
    root = make_root()
    chain = make_chain(root, cfg["n_blocks"])
    # Same KV (seed = block index) in every worker, created at a worker-specific time:
    # whichever worker wins a key, the payload bytes are the same.
    snaps = [make_snapshot(root, b, layers=cfg["layers"], heads=4, head_dim=64, seed=i,
                           created_at=time.time() + wid * 0.001)
             for i, b in enumerate(chain)]
    expected = [[bytes(buf) for buf in s.buffers] for s in snaps]
    store, tier = _store(cfg)
    result = {"puts": 0, "wrote": 0, "gets": 0, "hits": 0, "misses": 0, "torn": [], "errors": []}
    _touch(cfg["ready"])
    _wait_for(cfg["go"])
    rng = random.Random(1000 + wid)

    def check_get(i: int) -> None:
        result["gets"] += 1
        try:
            snap = store.get(ACME, chain[i], root)
        except Exception:
            result["errors"].append(traceback.format_exc())
            return
        if snap is None:
            result["misses"] += 1
            return
        result["hits"] += 1
        h = snap.header
        if h.key != chain[i].key or h.token_ids != chain[i].tokens:
            result["torn"].append(f"block {i}: got header of {h.key}")
        for part, want in zip(h.parts, expected[i]):
            if snap.array(part.name).tobytes() != want:
                result["torn"].append(f"block {i}: part {part.name} differs")
        snap.close()

    n = len(chain)
    for r in range(cfg["rounds"]):
        # Round 0: every worker in the same order (all race for the same key at once);
        # then reversed, then a per-worker shuffle.
        order = list(range(n)) if r == 0 else list(reversed(range(n))) if r == 1 else rng.sample(range(n), n)
        for i in order:
            check_get(i)
            try:
                result["puts"] += 1
                result["wrote"] += int(store.put(ACME, snaps[i]))
            except Exception:
                result["errors"].append(traceback.format_exc())
            check_get(i)
    result["stats"] = store.stats.as_dict()
    store.close()
    _write_json(cfg["out"], result)


# -- concurrency: different keys under a small cap ------------------------------------
def diff_keys(cfg: dict) -> None:
    torch.set_num_threads(1)
    wid = cfg["worker"]
    root = make_root()
    chain = make_chain(root, cfg["n_writes"], start=(wid + 1) * 1_000_000)
    rng = random.Random(2000 + wid)
    snaps = [make_snapshot(root, b, layers=rng.choice(cfg["layers"]), heads=4, head_dim=64, seed=wid * 1000 + i)
             for i, b in enumerate(chain)]
    store, tier = _store(cfg)
    cap = cfg["cap"]
    result = {"writes": 0, "store_full": 0, "errors": [], "max_index": 0, "over_cap": [],
              "hits": 0, "misses": 0, "torn": []}

    def sample(where: str) -> None:
        # the bytes reserved in the index, in one SELECT: exact while the others work (a
        # directory walk is not); files and temp files never exceed their reservations
        index = tier.usage()
        result["max_index"] = max(result["max_index"], index)
        if index > cap:
            result["over_cap"].append(f"{where}: index={index} cap={cap}")

    _touch(cfg["ready"])
    _wait_for(cfg["go"])
    for i, snap in enumerate(snaps):
        try:
            store.put(ACME, snap)
            result["writes"] += 1
        except StoreFull as exc:
            result["store_full"] += 1
            result["errors"].append(f"StoreFull: {exc}")
        except Exception:
            result["errors"].append(traceback.format_exc())
        sample(f"after write {i}")
        j = rng.randrange(i + 1)
        try:
            got = store.get(ACME, chain[j], root)
        except Exception:
            result["errors"].append(traceback.format_exc())
            got = None
        if got is None:
            result["misses"] += 1
        else:
            result["hits"] += 1
            if got.header.key != chain[j].key or any(
                got.array(p.name).tobytes() != bytes(buf) for p, buf in zip(got.header.parts, snaps[j].buffers)
            ):
                result["torn"].append(f"block {j}")
            got.close()
        sample(f"after read {i}")
    result["stats"] = store.stats.as_dict()
    store.close()
    _write_json(cfg["out"], result)


COMMANDS = {"zygote": zygote, "reader": reader, "same_keys": same_keys, "diff_keys": diff_keys}


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    COMMANDS[argv[1]](json.loads(argv[2]))


if __name__ == "__main__":
    main(sys.argv)
