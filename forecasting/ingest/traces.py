"""Request traces as block chains: the Mooncake format and kvwarm's own request logs.

A :class:`Trace` holds one row per request (arrival time, tenant, token counts) and
each request's chain of block ids in CSR form (``offsets`` into ``block_ids``), all
numpy arrays, so a 12k-request, 288k-block trace loads in a fraction of a second and
replays without Python objects per block. Block ids are chained: two requests share
block id ``b`` at position ``j`` only when their first ``j + 1`` blocks are equal,
the prefix semantics of vLLM's prefix cache and of :mod:`store.identity.keys`.

Two readers:

- :func:`read_mooncake`: the FAST'25 Mooncake traces (``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids`` one id per 512-token block).
- :func:`read_kvwarm`: kvwarm request logs, JSONL or Parquet, one row per request with
  ``timestamp`` (seconds), ``tenant`` and either ``block_keys`` (hex keys computed by
  :func:`store.identity.keys.block_keys`) or ``token_ids`` (then keyed here with a simulation
  :class:`~store.identity.keys.KeyRoot` per tenant and the given block size).

Malformed rows raise :class:`TraceError` naming the file, the line (or row) and the field.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from forecasting.ingest.block_size import MOONCAKE_BLOCK_TOKENS, TraceError, mooncake_block_tokens
from store.format.precision import Precision
from store.identity.keys import KeyRoot, block_keys, check_key
from store.identity.tenant import Tenant

__all__ = ["FORMATS", "MOONCAKE_BLOCK_TOKENS", "Request", "Trace", "TraceError", "assemble", "from_chains",
           "mooncake_block_tokens", "read_kvwarm", "read_mooncake", "read_trace", "simulation_root"]

FORMATS = ("mooncake", "kvwarm")


@dataclass(frozen=True)
class Request:
    """One request of a trace, as :meth:`Trace.requests` yields it."""

    index: int
    timestamp_s: float
    tenant: str
    input_tokens: int
    output_tokens: int
    blocks: np.ndarray


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests in arrival order with their block chains, as numpy arrays.

    Attributes:
        timestamps_s: float64, seconds from ``start_s`` (non-decreasing, first is 0 for
            Mooncake; kvwarm logs are shifted so their first request is at 0).
        input_tokens: int64 prompt length of each request.
        output_tokens: int64 generated length of each request (0 when unknown).
        offsets: int64, length ``n + 1``: request ``i``'s chain is
            ``block_ids[offsets[i]:offsets[i + 1]]``.
        block_ids: int64 block ids of every chain, concatenated.
        tenants: one tenant name for the whole trace, or an object array of names.
        block_tokens: tokens per block (512 for Mooncake).
        start_s: absolute time of ``timestamps_s == 0`` (0 for Mooncake).
        key_names: for kvwarm logs, the hex block key of each id (``key_names[id]``).
    """

    timestamps_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    offsets: np.ndarray
    block_ids: np.ndarray
    tenants: str | np.ndarray = "default"
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    start_s: float = 0.0
    key_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.timestamps_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n or len(self.offsets) != n + 1:
            raise ValueError("trace arrays disagree on the number of requests")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.block_ids) or np.any(np.diff(self.offsets) < 0):
            raise ValueError("trace offsets must start at 0, be non-decreasing and end at len(block_ids)")
        if n and np.any(np.diff(self.timestamps_s) < 0):
            raise ValueError("trace timestamps must be non-decreasing (sort the requests by time)")
        if not isinstance(self.tenants, str) and len(self.tenants) != n:
            raise ValueError("trace tenants must be one name or one name per request")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")

    def __len__(self) -> int:
        return len(self.timestamps_s)

    @property
    def n_blocks(self) -> int:
        """Total block references (sum of chain lengths)."""
        return len(self.block_ids)

    @property
    def duration_s(self) -> float:
        """Time from the first to the last request."""
        return float(self.timestamps_s[-1] - self.timestamps_s[0]) if len(self) else 0.0

    def chain(self, i: int) -> np.ndarray:
        """Block ids of request ``i`` (a view, root block first)."""
        return self.block_ids[self.offsets[i] : self.offsets[i + 1]]

    def tenant(self, i: int) -> str:
        """Tenant of request ``i``."""
        return self.tenants if isinstance(self.tenants, str) else str(self.tenants[i])

    def chain_lengths(self) -> np.ndarray:
        """Number of blocks of each request."""
        return np.diff(self.offsets)

    def block_request(self) -> np.ndarray:
        """For each entry of ``block_ids``, the index of its request."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.chain_lengths())

    def block_depths(self) -> np.ndarray:
        """For each entry of ``block_ids``, its position in its chain (0 = root block)."""
        return np.arange(self.n_blocks, dtype=np.int64) - np.repeat(self.offsets[:-1], self.chain_lengths())

    def block_token_counts(self) -> np.ndarray:
        """Prompt tokens each entry of ``block_ids`` stands for.

        ``block_tokens`` for full blocks; the final partial block of a Mooncake chain
        counts its remainder. Tokens past a chain's last keyed block (a partial block
        kvwarm does not key) are in ``input_tokens`` only: they can never hit.
        """
        rest = np.repeat(self.input_tokens, self.chain_lengths()) - self.block_tokens * self.block_depths()
        return np.clip(rest, 0, self.block_tokens)

    def requests(self) -> Iterator[Request]:
        """Yield every request in arrival order."""
        for i in range(len(self)):
            yield Request(i, float(self.timestamps_s[i]), self.tenant(i), int(self.input_tokens[i]),
                          int(self.output_tokens[i]), self.chain(i))

    def select(self, rows: np.ndarray) -> Trace:
        """A trace of the requests at ``rows`` (sorted indices or a boolean mask), block ids unchanged."""
        idx = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows, dtype=np.int64)
        lengths = self.chain_lengths()[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        take = np.repeat(self.offsets[idx] - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        tenants = self.tenants if isinstance(self.tenants, str) else self.tenants[idx]
        return Trace(self.timestamps_s[idx], self.input_tokens[idx], self.output_tokens[idx], offsets,
                     self.block_ids[take], tenants, self.block_tokens, self.start_s, self.key_names)


def from_chains(timestamps_s: Sequence[float], chains: Sequence[Sequence[int]], *, block_tokens: int = 1,
                input_tokens: Sequence[int] | None = None, tenant: str = "default") -> Trace:
    """Build a trace from Python lists (tests, hand-made examples).

    ``input_tokens`` defaults to full blocks (``len(chain) * block_tokens``).
    """
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    offsets = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(chains), dtype=np.int64, count=int(offsets[-1]))
    inp = lengths * block_tokens if input_tokens is None else np.asarray(input_tokens, dtype=np.int64)
    return Trace(np.asarray(timestamps_s, dtype=np.float64), inp, np.zeros(len(chains), dtype=np.int64),
                 offsets, ids, tenant, block_tokens)


def _int(row: dict[str, Any], name: str, where: str, *, minimum: int = 0) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < minimum \
            or (isinstance(value, float) and not value.is_integer()):
        raise TraceError(f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _number(row: dict[str, Any], name: str, where: str) -> float:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{where}: field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise TraceError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            yield where, row


def assemble(ts: Sequence[float], inp: Sequence[int], out: Sequence[int], chains: list[list[int]], tenants: list[str],
             block_tokens: int, key_names: tuple[str, ...] | None, path: str | Path) -> Trace:
    """A trace from per-request lists (any order; sorted by time here, times shifted to start at 0).

    ``path`` only names the source in the error for an empty trace.

    Raises:
        TraceError: there are no requests.
    """
    if not ts:
        raise TraceError(f"trace {path} has no requests")
    times = np.asarray(ts, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    sorted_already = bool(np.all(order == np.arange(len(order))))
    if not sorted_already:
        chains = [chains[i] for i in order]
        tenants = [tenants[i] for i in order]
    lengths = np.fromiter((len(c) for c in chains), dtype=np.int64, count=len(chains))
    offsets = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(chains), dtype=np.int64, count=int(offsets[-1]))
    start = float(times[order[0]])
    names = set(tenants)
    tenant_col: str | np.ndarray = tenants[0] if len(names) == 1 else np.asarray(tenants, dtype=object)
    return Trace(times[order] - start, np.asarray(inp, dtype=np.int64)[order], np.asarray(out, dtype=np.int64)[order],
                 offsets, ids, tenant_col, block_tokens, start, key_names)


def read_mooncake(path: str | Path, *, tenant: str = "mooncake", block_tokens: int | None = None) -> Trace:
    """Read a Mooncake trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

    Each hash id stands for one block of the trace's block size: every row has
    ``ceil(input_length / block) == len(hash_ids)``. Without ``block_tokens`` the size is
    inferred (:func:`mooncake_block_tokens`): Mooncake's 512 when every row fits it.

    Args:
        path: the ``.jsonl`` file.
        tenant: the tenant name given to every request.
        block_tokens: tokens per hash id (default: inferred).

    Raises:
        TraceError: unreadable file, invalid JSON, a row whose field is missing or has
            the wrong type (the message gives ``path:line`` and the field), or lengths that
            contradict ``block_tokens`` (or fit no block size).
    """
    path = Path(path)
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    chains: list[list[int]] = []
    wheres: list[str] = []
    for where, row in _json_lines(path):
        ts.append(_number(row, "timestamp", where) / 1000.0)
        inp.append(_int(row, "input_length", where))
        out.append(_int(row, "output_length", where))
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers, got {str(ids)[:60]!r}")
        chains.append(ids)
        wheres.append(where)
    lengths = np.array(inp, dtype=np.int64)
    counts = np.array([len(c) for c in chains], dtype=np.int64)
    size = mooncake_block_tokens(lengths, counts, path=path, wheres=wheres, block_tokens=block_tokens)
    return assemble(ts, inp, out, chains, [tenant] * len(ts), size, None, path)


@functools.lru_cache(maxsize=4096)
def simulation_root(tenant: str, block_size: int, *, model: str = "simulate") -> KeyRoot:
    """The key root used to key ``token_ids`` logs for simulation (not a serving root).

    Remembered per arguments: every reader and the plan's keying ask for it once a tenant.

    Equal token prefixes of one tenant get equal keys; tenants never share keys. The
    keys do not match a real model's snapshots, which a simulation does not need.
    """
    precision = Precision()
    return KeyRoot(model, "simulate", precision.kv_dtype, precision.scheme_id(), block_size,
                   Tenant.derive(tenant).salt)


def _kvwarm_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        except (OSError, ValueError) as exc:
            raise TraceError(f"cannot read Parquet trace {path}: {exc}") from exc
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{path} row {i}", row
    else:
        yield from _json_lines(path)


def read_kvwarm(path: str | Path, *, block_size: int | None = None, model: str = "simulate") -> Trace:
    """Read a kvwarm request log (JSONL, or Parquet when the name ends in ``.parquet``).

    Each row: ``timestamp`` (seconds, any origin), ``tenant``, and either ``block_keys``
    (list of 64-hex keys, root block first) or ``token_ids`` (list of ints, keyed here
    with :func:`simulation_root`). Optional ``input_tokens`` (default: the token count,
    or ``len(block_keys) * block_size``) and ``output_tokens`` (default 0).

    Args:
        path: the log file.
        block_size: tokens per block; required for ``token_ids`` rows, and for
            ``block_keys`` rows sets the token count of each block (default 256,
            kvwarm's configured default).
        model: model name mixed into the simulation root for ``token_ids`` rows.

    Raises:
        TraceError: unreadable file or a malformed row (named with its line and field).
    """
    path = Path(path)
    size = 256 if block_size is None else int(block_size)
    if size < 1:
        raise TraceError(f"block size must be positive, got {block_size}")
    intern: dict[str, int] = {}
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    chains: list[list[int]] = []
    tenants: list[str] = []
    for where, row in _kvwarm_rows(path):
        ts.append(_number(row, "timestamp", where))
        tenant = row.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise TraceError(f"{where}: field 'tenant' must be a non-empty string, got {tenant!r}")
        keys, tokens = row.get("block_keys"), row.get("token_ids")
        if (keys is None) == (tokens is None):
            raise TraceError(f"{where}: give exactly one of 'block_keys' or 'token_ids'")
        if tokens is not None:
            if block_size is None:
                raise TraceError(f"{where}: 'token_ids' rows need a block size (--block-size)")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
            ):
                raise TraceError(f"{where}: field 'token_ids' must be a list of integers in [0, 2**32)")
            try:
                root = simulation_root(tenant, size, model=model)
            except ValueError as exc:
                raise TraceError(f"{where}: field 'tenant': {exc}") from exc
            try:
                keys = block_keys(root, tokens)
            except ValueError as exc:
                raise TraceError(f"{where}: field 'token_ids': {exc}") from exc
            n_tokens = len(tokens)
        else:
            if not isinstance(keys, list):
                raise TraceError(f"{where}: field 'block_keys' must be a list of hex keys")
            for k in keys:
                try:
                    check_key(k)
                except ValueError as exc:
                    raise TraceError(f"{where}: field 'block_keys': {exc}") from exc
            n_tokens = len(keys) * size
        chains.append([intern.setdefault(k, len(intern)) for k in keys])
        inp.append(_int(row, "input_tokens", where) if row.get("input_tokens") is not None else n_tokens)
        out.append(_int(row, "output_tokens", where) if row.get("output_tokens") is not None else 0)
        tenants.append(tenant)
    return assemble(ts, inp, out, chains, tenants, size, tuple(intern), path)


def read_trace(path: str | Path, fmt: str = "mooncake", *, block_size: int | None = None,
               tenant: str = "mooncake", model: str = "simulate") -> Trace:
    """Read a trace in ``fmt`` (one of :data:`FORMATS`); see :func:`read_mooncake` (``block_size``: its
    ``block_tokens``, default inferred) and :func:`read_kvwarm`."""
    if fmt == "mooncake":
        return read_mooncake(path, tenant=tenant, block_tokens=block_size)
    if fmt == "kvwarm":
        return read_kvwarm(path, block_size=block_size, model=model)
    raise ValueError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
