"""Unseen traces of other shapes, for the replay: sparse 24-hour traffic, 32-token blocks, agents.

Each generator is deterministic given its seed and writes a Mooncake-format trace (JSONL:
``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``: one id per block of
``block_tokens``, chained, so equal ids mean an equal prefix up to that block; the last
block may be partial, ``len(hash_ids) == ceil(input_length / block_tokens)``).

- ``sparse-24h``: 24 hours of two ServeGen clients' real arrival rates, one row per 600 s
  window (``chunk-5`` and ``chunk-17`` of alibaba/ServeGen ``data/language/m-large``,
  Apache-2.0, Copyright Alibaba; the first day of the subset bundled in
  ``tests/data/servegen/``, see its README). Both are idle from 02:30 to 09:30, so the
  node sees a fully idle period of about 7 hours. Rates are scaled by ``scale`` (0.1: about
  11,000 requests in the day) and drive conversation starts; arrivals in a window are a
  gamma renewal process with the window's rate and coefficient of variation. Each client
  has two system prompts of its own; a conversation's later turns follow its own clock and
  are dropped where they would land in a window its client is idle (it ended).
- ``blocks-32``: the same conversations (one client, a steady rate of one start every 2 s,
  30 minutes) keyed in 32-token blocks.
- ``agent``: synthetic agent sessions: a few shared system prompts with tool schemas (4,000
  to 9,000 tokens), a task, then many steps seconds apart (a lognormal step gap of median
  4 s: decode and tool latency), each appending the model's tool call and the tool's
  output to a growing context; 5 to 60 steps (median 15), sessions minutes long, a new
  session every 20 s for 2 hours.

Conversation structure (turns, gaps, growth) follows statistics measured on the Mooncake
conversation trace (FAST'25, 12,031 requests): 1.63 turns per conversation (69 % one
turn: a continuation probability of 0.39), a gap between turns of median 123 s and 90th
percentile 480 s (lognormal), a first prompt of median 5,264 tokens (10th percentile 905),
an output of median 350 tokens, and each turn adding the previous output and a user
message of median 455 tokens; a later turn repeats its previous turn's whole prompt, so
its full blocks keep their ids. These are assumptions of the generator, not fits to the
traces it writes.

Usage::

    python -m bench.lib.trace_suite --out DIR [--seed 0] [--servegen FOLDER]

writes ``DIR/sparse-24h.jsonl``, ``DIR/blocks-32.jsonl``, ``DIR/agent.jsonl`` and
``DIR/suite.json`` (per trace: requests, duration, block size, and its longest idle
period, so an event can be put right after it: ``prefill simulate --at SECONDS``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.servegen import WINDOW_S, read_client  # noqa: E402
from store.errors import BadInputError  # noqa: E402

#: the bundled ServeGen subset (two days of three clients)
BUNDLED_SERVEGEN = ROOT / "tests" / "data" / "servegen"
SPARSE_CLIENTS = ("chunk-5", "chunk-17")
TRACES = ("sparse-24h", "blocks-32", "agent")
_DAY_S = 24 * 3600


@dataclass(frozen=True)
class Request:
    """One generated request (seconds; tokens; chained block ids)."""

    t_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> dict:
        return {"timestamp": int(round(self.t_s * 1000)), "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


@dataclass
class Blocks:
    """Hands out chained block ids: a context's full blocks keep theirs, new content gets new ones."""

    block_tokens: int
    next_id: int = 0

    def extend(self, full: list[int], full_tokens: int, length: int) -> list[int]:
        """Ids of a prompt of ``length`` tokens that begins with a context whose first
        ``len(full)`` blocks (``full_tokens`` tokens, whole blocks) are ``full``."""
        n = math.ceil(length / self.block_tokens)
        keep = min(len(full), full_tokens // self.block_tokens, n)
        new = list(range(self.next_id, self.next_id + n - keep))
        self.next_id += n - keep
        return full[:keep] + new


@dataclass
class Context:
    """A growing prompt: its length in tokens and the ids of its full blocks."""

    length: int = 0
    full: list[int] = field(default_factory=list)

    def request(self, blocks: Blocks, t_s: float, length: int, output: int) -> Request:
        """The request of a prompt of ``length`` tokens that extends this context; the context
        becomes that prompt (its full blocks)."""
        ids = blocks.extend(self.full, self.length, length)
        self.length, self.full = length, ids[: length // blocks.block_tokens]
        return Request(t_s, length, output, tuple(ids))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: float = 1.0) -> float:
    return max(low, float(median * math.exp(sigma * rng.standard_normal())))


def _system_prompts(rng: np.random.Generator, blocks: Blocks, lengths: list[int]) -> list[Context]:
    return [Context(n, blocks.extend([], 0, n)[: n // blocks.block_tokens]) for n in lengths]


def conversation(rng: np.random.Generator, blocks: Blocks, system: Context, start_s: float,
                 active: "np.ndarray | None" = None) -> list[Request]:
    """One conversation's turns from ``start_s`` (Mooncake's structure, the module docstring).
    ``active``: per 600 s window, whether the client has traffic; a turn landing in an idle
    window ends the conversation."""
    ctx = Context(system.length, list(system.full))
    t, length, out = start_s, system.length + int(_lognormal(rng, 5264.0, 1.37, 64)), 0
    turns: list[Request] = []
    while True:
        if active is not None:
            w = int(t // WINDOW_S)
            if w >= len(active) or not active[w]:
                break
        out = int(_lognormal(rng, 350.0, 1.0, 1))
        turns.append(ctx.request(blocks, t, length, out))
        if rng.random() >= 0.39:
            break
        t += _lognormal(rng, 123.0, 1.06, 5.0)
        length += out + int(_lognormal(rng, 455.0, 1.2, 8))
    return turns


def _renewal(rng: np.random.Generator, start_s: float, end_s: float, rate: float, cv: float) -> list[float]:
    """Arrival times in ``[start_s, end_s)`` of a gamma renewal process (mean ``1 / rate``, CV ``cv``)."""
    if rate <= 0:
        return []
    k = 1.0 / min(max(cv, 0.2), 10.0) ** 2
    out, t = [], start_s + rng.gamma(k, 1.0 / (rate * k))
    while t < end_s:
        out.append(float(t))
        t += rng.gamma(k, 1.0 / (rate * k))
    return out


def _servegen_windows(folder: Path, client: str) -> tuple[np.ndarray, np.ndarray]:
    """The first day's per-window rate and CV of one ServeGen client (idle windows: rate 0)."""
    path = folder / f"{client}-trace.csv"
    trace = read_client(path)
    cv = np.zeros(len(trace.rate))
    for i, line in enumerate(l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()):
        cv[i] = float(line.split(",")[2] or 0.0)
    n = _DAY_S // WINDOW_S
    rate = np.zeros(n)
    cvs = np.ones(n)
    w = trace.window_start_s // WINDOW_S
    keep = w < n
    rate[w[keep]], cvs[w[keep]] = trace.rate[keep], cv[keep]
    return rate, cvs


def sparse_24h(seed: int = 0, *, servegen: Path = BUNDLED_SERVEGEN, scale: float = 0.1,
               clients: tuple[str, ...] = SPARSE_CLIENTS) -> list[Request]:
    """24 hours of conversations at ServeGen clients' real rates (the module docstring).

    Raises:
        BadInputError: ``scale`` is not positive, or a client's file is missing or malformed.
    """
    if not scale > 0:
        raise BadInputError(f"sparse-24h: scale must be > 0, got {scale!r}")
    rng = np.random.default_rng(seed)
    blocks = Blocks(512)
    out: list[Request] = []
    for client in clients:
        rate, cv = _servegen_windows(Path(servegen), client)
        systems = _system_prompts(rng, blocks, [int(_lognormal(rng, 2000.0, 0.5, 600)) for _ in range(2)])
        active = rate > 0
        for w in np.flatnonzero(active):
            for t in _renewal(rng, w * WINDOW_S, (w + 1) * WINDOW_S, rate[w] * scale / 1.63, cv[w]):
                out += conversation(rng, blocks, systems[int(rng.random() < 0.3)], t, active)
    return sorted(out, key=lambda r: r.t_s)


def blocks_32(seed: int = 0, *, duration_s: float = 1800.0, start_every_s: float = 2.0) -> list[Request]:
    """Conversations in 32-token blocks: one client, a start every ``start_every_s`` on average."""
    rng = np.random.default_rng(seed)
    blocks = Blocks(32)
    systems = _system_prompts(rng, blocks, [1800, 3100])
    out: list[Request] = []
    for t in _renewal(rng, 0.0, duration_s, 1.0 / start_every_s, 1.0):
        out += [r for r in conversation(rng, blocks, systems[int(rng.random() < 0.3)], t) if r.t_s < duration_s]
    return sorted(out, key=lambda r: r.t_s)


def agent(seed: int = 0, *, duration_s: float = 7200.0, session_every_s: float = 20.0) -> list[Request]:
    """Agent sessions: tool-call loops appending to a growing context (the module docstring)."""
    rng = np.random.default_rng(seed)
    blocks = Blocks(512)
    systems = _system_prompts(rng, blocks, [4200, 6500, 8800])
    out: list[Request] = []
    for start in _renewal(rng, 0.0, duration_s, 1.0 / session_every_s, 1.0):
        system = systems[int(rng.choice(3, p=[0.5, 0.3, 0.2]))]
        ctx = Context(system.length, list(system.full))
        length = system.length + int(_lognormal(rng, 300.0, 0.8, 20))  # the task
        t = start
        for _ in range(int(min(60, max(5, _lognormal(rng, 15.0, 0.6))))):
            call = int(_lognormal(rng, 80.0, 0.6, 10))
            out.append(ctx.request(blocks, t, length, call))
            length += call + int(_lognormal(rng, 400.0, 1.1, 10))  # the tool's output
            t += _lognormal(rng, 4.0, 0.6, 0.5)
    return sorted((r for r in out if r.t_s < duration_s), key=lambda r: r.t_s)


def idle_periods(requests: list[Request], *, at_least_s: float = 0.0) -> list[tuple[float, float]]:
    """``(last request before, first request after)`` of each gap of at least ``at_least_s``, longest first."""
    t = np.array([r.t_s for r in requests])
    gaps = np.diff(t)
    at = np.flatnonzero(gaps >= at_least_s)
    return [(float(t[i]), float(t[i + 1])) for i in at[np.argsort(-gaps[at], kind="stable")]]


def write_trace(requests: list[Request], path: Path) -> Path:
    """Write requests as Mooncake JSONL (times from the first request, ms)."""
    t0 = requests[0].t_s if requests else 0.0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({**r.to_json(), "timestamp": int(round((r.t_s - t0) * 1000))}) + "\n")
    return path


def build(name: str, seed: int = 0, *, servegen: Path = BUNDLED_SERVEGEN) -> tuple[list[Request], int]:
    """One trace of the suite and its block size.

    Raises:
        BadInputError: an unknown name (the message lists the suite).
    """
    if name == "sparse-24h":
        return sparse_24h(seed, servegen=servegen), 512
    if name == "blocks-32":
        return blocks_32(seed), 32
    if name == "agent":
        return agent(seed), 512
    raise BadInputError(f"unknown trace {name!r}; the suite holds {', '.join(TRACES)}")


def write_suite(out: Path, seed: int = 0, *, servegen: Path = BUNDLED_SERVEGEN) -> dict:
    """Write every trace of the suite under ``out`` and ``suite.json``; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"seed": seed, "traces": {}}
    for name in TRACES:
        requests, block = build(name, seed, servegen=servegen)
        path = write_trace(requests, out / f"{name}.jsonl")
        t0 = requests[0].t_s
        idle = [(a - t0, b - t0) for a, b in idle_periods(requests)[:1]]
        manifest["traces"][name] = {
            "file": path.name, "requests": len(requests), "block_tokens": block,
            "blocks": sum(len(r.hash_ids) for r in requests), "duration_s": round(requests[-1].t_s - t0, 3),
            "longest_idle_s": [round(idle[0][0], 3), round(idle[0][1], 3)] if idle else None}
    (out / "suite.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the traces and suite.json")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    ap.add_argument("--servegen", type=Path, default=BUNDLED_SERVEGEN,
                    help="folder with ServeGen chunk-N-trace.csv (default: the bundled subset, tests/data/servegen)")
    args = ap.parse_args(argv)
    try:
        manifest = write_suite(args.out, args.seed, servegen=args.servegen)
    except BadInputError as exc:
        print(f"trace_suite: {exc}", file=sys.stderr)
        return 2
    for name, m in manifest["traces"].items():
        idle = m["longest_idle_s"]
        print(f"{name:<11} {m['requests']:>6} requests, {m['blocks']:>8} blocks of {m['block_tokens']} tokens, "
              f"{m['duration_s'] / 3600:.2f} h; longest idle {(idle[1] - idle[0]) / 3600:.2f} h "
              f"({idle[0]:.0f} s to {idle[1]:.0f} s)")
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
