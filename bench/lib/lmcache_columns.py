"""The engine bench's LMCache columns, as figures: scenarios, ratios, targets, log lines, bytes (pure).

The engine bench (bench/engine_bench.py) runs kvwarm and LMCache on the same vLLM and the
same prompts, one engine per system and phase, and hands this module what it measured:
per scenario and system, each repeat's time to first token and the tokens the engine did not
compute (``num_cached_tokens`` of a prompt the engine never saw: all of them came from the
system's cache). Nothing here starts a process or reads a clock.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: The columns, in the order they are printed: nothing cached anywhere; the engine (and
#: LMCache's server) restarted on the same local disk; a new node with an empty local tier and
#: the shared S3 bucket as the only copy; a prefix no request has sent, which kvwarm's plan
#: prefilled ahead of time (LMCache can only compute it).
SCENARIOS = ("cold", "restart", "replacement", "announced")
SYSTEMS = ("kvwarm", "lmcache")
#: kvwarm's TTFT over LMCache's, where both hit; and on the announced prefix
TARGET_VS_LMCACHE, TARGET_ANNOUNCED = 1.0, 0.1

_TRANSFER = re.compile(r"\b(Stored|Retrieved) (\d+) tokens in ([0-9.]+) seconds")


@dataclass(frozen=True)
class Transfer:
    """One ``Stored N tokens in X seconds`` / ``Retrieved ...`` line of LMCache's server log.

    ``Retrieved`` times the copy of a request's prefix from the server's L1 (DRAM) into
    vLLM's paged cache (``lmcache_driven_transfer.retrieve``); an L2 read comes before it, at
    lookup, and shows in the time to first token only.
    """

    kind: str  # "Stored" or "Retrieved"
    tokens: int
    seconds: float


def transfers(log: str) -> list[Transfer]:
    """Every store and retrieve line of an LMCache server log, in order."""
    return [Transfer(m[1], int(m[2]), float(m[3])) for m in _TRANSFER.finditer(log)]


def throughput_GBps(tokens: int, seconds: float, bytes_per_token: int) -> float | None:
    """Engine-dtype bytes of ``tokens`` over ``seconds``, in GB/s (``None`` when nothing was timed)."""
    return tokens * bytes_per_token / seconds / 1e9 if tokens and seconds > 0 else None


def retrieved_GBps(found: Iterable[Transfer], bytes_per_token: int) -> dict[str, float | None]:
    """LMCache's load throughput from its ``Retrieved`` lines: all their tokens over all their seconds."""
    got = [t for t in found if t.kind == "Retrieved"]
    tokens, seconds = sum(t.tokens for t in got), sum(t.seconds for t in got)
    return {"retrieves": len(got), "tokens": tokens, "seconds": seconds,
            "GBps": throughput_GBps(tokens, seconds, bytes_per_token)}


def bytes_per_token(sizes: Sequence[int], tokens_per_object: int) -> dict[str, float | int | None]:
    """Stored bytes per cached token, where each object holds ``tokens_per_object`` tokens (one block or chunk)."""
    n, total = len(sizes), sum(sizes)
    return {"objects": n, "bytes": total, "bytes_per_token": total / (n * tokens_per_object) if n else None}


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-repeat ratios ``a[i] / b[i]`` (repeats paired by prompt)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need paired, non-empty repeats; got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


def hit(tokens: Sequence[int]) -> bool:
    """Whether every repeat of a scenario got tokens from the system's cache."""
    return bool(tokens) and all(t > 0 for t in tokens)


def table(ttft: Mapping[str, Mapping[str, Sequence[float]]],
          cached: Mapping[str, Mapping[str, Sequence[int]]]) -> dict[str, dict]:
    """Per scenario: each system's median TTFT, its ratio to its own cold, kvwarm over LMCache, the hits.

    ``ttft[system][scenario]`` and ``cached[system][scenario]`` are per repeat, repeat ``i`` of
    every scenario and system on the same prompt (the announced one has prompts of its own).
    """
    out: dict[str, dict] = {}
    for s in SCENARIOS:
        row: dict = {}
        for sys_ in SYSTEMS:
            row[sys_] = {"ttft_s": statistics.median(ttft[sys_][s]),
                         "over_cold": median_ratio(ttft[sys_][s], ttft[sys_]["cold"]),
                         "cached_tokens": list(cached[sys_][s]), "hit": hit(cached[sys_][s])}
        row["kvwarm_over_lmcache"] = median_ratio(ttft["kvwarm"][s], ttft["lmcache"][s])
        row["both_hit"] = row["kvwarm"]["hit"] and row["lmcache"]["hit"]
        out[s] = row
    return out


def targets(rows: Mapping[str, Mapping]) -> dict[str, object]:
    """The issue's targets on :func:`table`'s rows.

    - every scenario where both systems hit: kvwarm's TTFT <= LMCache's (the median of the
      paired ratios <= :data:`TARGET_VS_LMCACHE`); no such scenario is a miss, not a pass;
    - the announced prefix: kvwarm <= :data:`TARGET_ANNOUNCED` x LMCache (kvwarm must hit it).
    """
    both = {s: r["kvwarm_over_lmcache"] <= TARGET_VS_LMCACHE for s, r in rows.items() if r["both_hit"]}
    announced = rows["announced"]
    return {"kvwarm_le_lmcache_where_both_hit": both,
            "kvwarm_le_lmcache_where_both_hit_met": bool(both) and all(both.values()),
            "announced_le_0.1x_lmcache_met": bool(announced["kvwarm"]["hit"])
            and announced["kvwarm_over_lmcache"] <= TARGET_ANNOUNCED}


def lines(rows: Mapping[str, Mapping]) -> list[str]:
    """One printed line per scenario."""
    out = []
    for s, r in rows.items():
        k, m = r["kvwarm"], r["lmcache"]
        out.append(f"{s:>11}: kvwarm {k['ttft_s']:.3f} s ({k['over_cold']:.3f} x cold, cached {k['cached_tokens']}), "
                   f"LMCache {m['ttft_s']:.3f} s ({m['over_cold']:.3f} x cold, cached {m['cached_tokens']}); "
                   f"kvwarm/LMCache {r['kvwarm_over_lmcache']:.3f}")
    return out
