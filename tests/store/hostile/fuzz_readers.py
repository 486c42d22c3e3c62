"""The entry points the fuzz test holds to its contract (tests/store/hostile/test_fuzz.py), run
on a copy of the template store: a serving loader and its lookup (and what an engine does with a
hit), the node agent over the loader's node, ``prefill store ls`` and ``verify`` in-process, the
fleet's records as the loader reads them, and the traced memory of a call.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import logging
import math
import os
import sqlite3
import tempfile
import tracemalloc
from pathlib import Path
from typing import Callable, Iterator

import torch

from prefill.cli import main as prefill_main
from store.errors import KvwarmError
from store.serving.agent import AgentSettings, NodeAgent, StorePlans
from store.serving.hit import LoaderHit
from store.serving.loader import KVLoader
from store.serving.loader_node import LoaderNode
from store.tiers.base import parse_object_name
from tests.store.hostile.fuzz_files import ACME, MODEL, PROMPT, THIS_NODE, Hostile, Template, config

#: where each example's store copy lives: memory where the host has it (the stores fsync their writes)
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@contextlib.contextmanager
def noted(hostile: Hostile) -> Iterator[None]:
    """Name the hostile file in a failure's report."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"with {hostile!r}")
        raise


@contextlib.contextmanager
def workspace(tpl: Template) -> Iterator[Path]:
    """A fresh copy of the template store; its local tier root."""
    with tempfile.TemporaryDirectory(prefix="kvwarm-fuzz-", dir=SCRATCH) as d:
        yield tpl.copy_to(Path(d))


class Untyped(logging.Handler):
    """Exceptions kvwarm logged with their traceback that are none of the typed ones: what a
    background thread (a prefetch stream, a fetch) caught as a crash instead of a miss."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and not isinstance(exc, (KvwarmError, OSError, sqlite3.Error)):
            self.seen.append(f"{record.name}: {record.getMessage()[:160]} ({type(exc).__name__}: {str(exc)[:160]})")


@contextlib.contextmanager
def loader_on(nvme: Path) -> Iterator[KVLoader]:
    """A serving-side loader of acme on the store at ``nvme``: opening it, its background threads
    and closing it must not raise (or log an untyped exception) either."""
    untyped = Untyped()
    logging.getLogger("kvwarm").addHandler(untyped)
    try:
        ld = KVLoader(f"file://{nvme}", tenant=ACME, model=MODEL, config=config(), pool_dir=nvme.parent / "pool",
                      pool_bytes=64 << 20, fetch_workers=1, prefetch_streams=1, node_id=THIS_NODE)
        try:
            yield ld
        finally:
            ld.prefetcher.wait_idle(30)
            ld.close()
    finally:
        logging.getLogger("kvwarm").removeHandler(untyped)
    assert not untyped.seen, f"kvwarm logged exceptions it did not expect: {untyped.seen}"


def run_cli(nvme: Path, *, public: bool = False) -> dict[str, int]:
    """``prefill store ls --long`` (also of the public namespace with ``public``) and ``prefill store
    verify --no-quarantine`` on the store: each exits 0, 1 or 2, and says why when not 0. Returns the
    exit status of each."""
    out = {}
    commands = [["ls", "--tenant", "acme", "--long"], ["verify", "--no-quarantine"]]
    if public:
        commands.insert(1, ["ls", "--tenant", "acme", "--namespace", "public"])
    for args in commands:
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            rc = prefill_main(["store", *args, "--store", f"file://{nvme}",
                               "--config", str(nvme.parent / "config.json")])
        assert rc in (0, 1, 2), f"prefill store {args[0]} exited {rc}"
        assert rc == 0 or text.getvalue().strip(), f"prefill store {args[0]} exited {rc} without a message"
        out["ls public" if "public" in args else args[0]] = rc
    return out


def check_lookup(ld: KVLoader) -> int:
    """One lookup of the prompt: a usable hit or a counted miss. Returns the blocks served."""
    hit, _ = ld.lookup_with_reason(PROMPT)
    m = ld.metrics.as_dict()
    assert m["lookups"] == 1 and m["hits"] + m["misses"] == 1, f"the lookup was not counted: {m}"
    if hit is None:
        return 0
    try:
        use_hit(hit)
        return len(hit.snapshots)
    finally:
        hit.release()


def use_hit(hit: LoaderHit) -> None:
    """What an engine does with a hit: it must work, whatever the files held."""
    lay = hit.layout
    assert all(s.header.layout == lay for s in hit.snapshots), "a hit mixes snapshots of different geometries"
    elements = 2 * lay.num_layers * lay.num_kv_heads * lay.block_size * lay.head_dim
    for s in hit.snapshots:  # every stored dtype takes at least a byte an element
        assert elements <= len(s.payload[0]), f"the layout {lay} describes more KV than the payload's {len(s.payload[0])} bytes"
    kv = hit.dequantized(torch.float32)
    assert len(kv) == 2 * lay.num_layers
    assert all(tuple(t.shape) == (lay.num_kv_heads, hit.usable_tokens, lay.head_dim) for t in kv)
    n = len(hit.snapshots)
    caches = [torch.zeros(2, n, lay.block_size, lay.num_kv_heads, lay.head_dim) for _ in range(lay.num_layers)]
    hit.copy_into_paged(caches, list(range(n)))


def new_agent(ld: KVLoader, now: float) -> NodeAgent:
    """The node agent of ``ld``'s node, following the plan published to its store, on a clock that stays at ``now``."""
    return NodeAgent(LoaderNode(ld, node_id=THIS_NODE), StorePlans(ld.store.tiers), AgentSettings(poll_s=30.0),
                     clock=lambda: now)


def check_fleet_uses(ld: KVLoader, now: float) -> int:
    """What the fleet's records say, as the loader reads them: finite times, counts of the right type.
    Returns how many uses were read."""
    uses = ld.fleet_uses(since=now - 7200)
    for u in uses:
        ns, _ = parse_object_name(u.name)
        assert ns in ("acme", "public")
        assert type(u.at) is float and math.isfinite(u.at) and u.at <= now + 86400, f"use at {u.at!r}"
        assert type(u.uses) is int and u.uses >= 1, f"uses {u.uses!r}"
        assert type(u.traffic_age) is int and u.traffic_age >= 0, f"traffic_age {u.traffic_age!r}"
    return len(uses)


def version_of(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest()[:16].encode()


def traced_peak(call: Callable[[], object]) -> int:
    """Peak traced memory during ``call`` above what was traced when it began (bytes)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
