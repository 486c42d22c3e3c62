"""A slice of a Mooncake-format trace as live requests: token ids per hash id, conversations kept, time compressed.

Pure (numpy and pandas, no engine): what :mod:`bench.live_replay` sends to vLLM, and the same
requests as log rows for the planner and the simulator.

- **Token ids.** Each hash id stands for one block of the trace's ``block_tokens`` (512 for
  Mooncake). Its tokens are drawn from a generator seeded by ``(seed, hash id)``: the same
  hash id always gives the same tokens, so chained prefixes (equal leading hash ids) are
  equal token prefixes, and different hash ids differ (from their first token, with
  overwhelming odds). A prompt is its hash ids' tokens, cut to ``input_length`` (the last
  block of a row is partial in Mooncake).
- **Slice** (:class:`SliceSpec`): the trace's requests with ``start_s <= timestamp < end_s``,
  of one conversation in ``every`` (a conversation is the requests that share their second
  hash id, the first is shared by every request of the conversation trace; a single-block
  request is a conversation of its own), each cut to its first ``max_blocks`` hash ids and
  ``max_tokens`` tokens, with time divided by ``speedup``.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecasting.ingest.traces import Trace


def block_token_ids(hash_id: int, block_tokens: int, vocab: int, *, seed: int = 0) -> np.ndarray:
    """The ``block_tokens`` token ids of one hash id: a pure function of ``(seed, hash_id)``, in ``[1, vocab)``.

    Token 0 is left out (the tiny model's BOS/EOS/pad).
    """
    if block_tokens < 1 or vocab < 2:
        raise ValueError(f"block_tokens must be >= 1 and vocab >= 2, got {block_tokens} and {vocab}")
    rng = np.random.default_rng([int(seed), int(hash_id) & 0xFFFFFFFFFFFF, int(hash_id) >> 48])
    return rng.integers(1, vocab, size=block_tokens, dtype=np.int64)


def prompt_token_ids(hash_ids: Sequence[int], n_tokens: int, block_tokens: int, vocab: int, *,
                     seed: int = 0) -> list[int]:
    """A request's prompt: its hash ids' blocks in order, cut to ``n_tokens``.

    Raises:
        ValueError: ``n_tokens`` needs more blocks than ``hash_ids`` gives, or is below 1.
    """
    if n_tokens < 1 or n_tokens > len(hash_ids) * block_tokens:
        raise ValueError(f"{n_tokens} tokens do not fit {len(hash_ids)} blocks of {block_tokens}")
    need = -(-n_tokens // block_tokens)
    parts = [block_token_ids(h, block_tokens, vocab, seed=seed) for h in hash_ids[:need]]
    return [int(t) for t in np.concatenate(parts)[:n_tokens]]


@dataclass(frozen=True)
class SliceSpec:
    """Which requests of a trace the live run replays, and how fast.

    Attributes:
        start_s, end_s: the trace's window (seconds of its own clock; ``end_s`` None: to its end).
        every: keep one conversation in ``every`` (1: all).
        max_blocks: cut each prompt to its first this many hash ids (0: no cut).
        speedup: the live clock runs this many times faster than the trace's.
        event_fraction: the replacement comes at this share of the slice's (live) duration.
        max_tokens: and cut each prompt to this many tokens (0: no cut).
    """

    start_s: float = 0.0
    end_s: float | None = None
    every: int = 1
    max_blocks: int = 0
    speedup: float = 1.0
    event_fraction: float = 0.5
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.max_blocks < 0 or self.max_tokens < 0 or not self.speedup > 0:
            raise ValueError(f"every >= 1, max_blocks >= 0 and speedup > 0, got {self.every}, {self.max_blocks}, "
                             f"{self.speedup}")
        if not 0 < self.event_fraction < 1:
            raise ValueError(f"event_fraction must be in (0, 1), got {self.event_fraction}")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")


@dataclass(frozen=True)
class LiveRequest:
    """One request of the slice: its live arrival (seconds from the slice's start), trace row and prompt."""

    at_s: float
    row: int
    hash_ids: tuple[int, ...]
    n_tokens: int
    output_tokens: int


def conversation_key(hash_ids: Sequence[int], row: int) -> int:
    """The conversation a request belongs to: its second hash id; a one-block request is its own (``-1 - row``)."""
    return int(hash_ids[1]) if len(hash_ids) > 1 else -1 - int(row)


def kept(key: int, every: int) -> bool:
    """Whether conversation ``key`` is in the sample of one in ``every`` (a stable hash, not the id's order)."""
    if every == 1:
        return True
    digest = hashlib.blake2b(str(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


def slice_trace(trace: Trace, spec: SliceSpec) -> list[LiveRequest]:
    """The slice's requests in arrival order (see :class:`SliceSpec`); the first arrives at 0."""
    ts = trace.timestamps_s
    end = float("inf") if spec.end_s is None else spec.end_s
    out: list[LiveRequest] = []
    t_first = None
    for i in range(len(ts)):
        t = float(ts[i])
        if t < spec.start_s or t >= end:
            continue
        ids = tuple(int(b) for b in trace.block_ids[trace.offsets[i]:trace.offsets[i + 1]])
        if not ids or not kept(conversation_key(ids, i), spec.every):
            continue
        if spec.max_blocks:
            ids = ids[:spec.max_blocks]
        n = min(int(trace.input_tokens[i]), len(ids) * trace.block_tokens)
        if spec.max_tokens:
            n = min(n, spec.max_tokens)
        t_first = t if t_first is None else t_first
        out.append(LiveRequest((t - t_first) / spec.speedup, i, ids, max(n, 1), int(trace.output_tokens[i])))
    return out


def event_time(requests: Sequence[LiveRequest], fraction: float) -> float:
    """The replacement's live time: ``fraction`` of the way to the last arrival."""
    return fraction * (requests[-1].at_s if requests else 0.0)


def log_rows(requests: Sequence[LiveRequest], prompts: Sequence[Sequence[int]], *, tenant: str, model: str,
             origin: pd.Timestamp) -> pd.DataFrame:
    """The requests as log rows (docs/reference/logs.md: ``token_ids`` rows), at ``origin`` + live time.

    What the planner mines and the simulator replays: the same token ids the engine is sent.
    """
    return pd.DataFrame({
        "timestamp": (origin + pd.to_timedelta([r.at_s for r in requests], unit="s")).astype("datetime64[us]"),
        "tenant": pd.Series([tenant] * len(requests), dtype=object), "model": model,
        "token_ids": pd.Series([list(p) for p in prompts], dtype=object),
        "prompt_tokens": pd.array([len(p) for p in prompts], dtype="Int64"),
        "output_tokens": pd.array([r.output_tokens for r in requests], dtype="Int64")})
