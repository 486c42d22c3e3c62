"""Block-validity ledger bench: what the worker's ledger costs vLLM's worker thread per step.

Issue 32 asks that what kvwarm runs inside vLLM's process be bounded by what each step
schedules, not by context length or the number of running requests, at <= 0.3 ms per step.
This drives :class:`store.engines.vllm.validity.BlockLedger` as the worker does
(``begin``, ``loaded``, ``computed``, ``vouched`` for each save) through steady decode
steps at each shape: R running requests at a C-token context (engine blocks of 16 tokens),
each decoding 1 token per step, beside ``--prefills`` requests prefilling ``--chunk``-token
chunks (their blocks loaded from kvwarm, then saved); a prefill that reaches C joins the
decoders and the oldest decoder ends, so the shape holds. The step's metadata is built
before the clock starts (the scheduler makes it), as the scheduler sends it: the steady decodes
(no new block) in bulk (:class:`store.engines.vllm.decodes.Decodes`), the other requests one by
one; the figure is the median over the timed
steps, then the median of ``--repeats`` runs. For comparison it times the ledger as it was
before it became incremental (``tests/store/engines/vllm/ledger_reference.py``, which walks
every context block every step) on the same steps. Last line: one JSON object.

    python bench/ledger_bench.py                      # 64 and 256 requests x 2k and 8k tokens
    python bench/ledger_bench.py --quick              # fewer steps and repeats, no walking ledger
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import count
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.results import Run, add_results_option, variant_of
from store.engines.vllm.decodes import Decodes
from store.engines.vllm.validity import BlockLedger, Compute

#: vLLM's engine block (tokens).
ENGINE_BLOCK = 16
#: (running requests, context tokens): the issue's shapes.
SHAPES = ((64, 2048), (64, 8192), (256, 2048), (256, 8192))
#: Issue 32's bound on kvwarm's time per step inside vLLM's process.
TARGET_MS = 0.3


class Workload:
    """Steady steps at one shape: the requests' tables and token counts, and each step's ledger calls."""

    def __init__(self, requests: int, context: int, *, prefills: int, chunk: int) -> None:
        self.context, self.chunk = context, chunk
        self.blocks = count(1)
        self.names = count()
        self.done: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.prefilling: list[str] = []
        self.first: list[Compute] = []
        for _ in range(requests - prefills):  # decoders already at the context (their tables given once)
            req = f"r{next(self.names)}"
            self.tables[req] = [next(self.blocks) for _ in range(context // ENGINE_BLOCK)]
            self.done[req] = context
            self.first.append(Compute(req, context - 1, 1, tuple(self.tables[req]), replace=True))
        for i in range(prefills):  # prefills staggered across the prompt
            req = f"r{next(self.names)}"
            self.done[req] = (i * context // prefills) // chunk * chunk
            self.tables[req] = [next(self.blocks) for _ in range(self.done[req] // ENGINE_BLOCK)]
            self.prefilling.append(req)
            self.first.append(Compute(req, 0, self.done[req], tuple(self.tables[req]), replace=True))

    def step(self) -> tuple[list[Compute], list[str], list[tuple[str, tuple[int, ...], int]], list[tuple]]:
        """The next step: its computes, the requests that ended, its loads and its saves."""
        computes, ended, loads, saves = [], [], [], []
        for req in list(self.done):
            if req in self.prefilling:
                continue
            new = ()
            if self.done[req] % ENGINE_BLOCK == 0:
                new = (next(self.blocks),)
                self.tables[req].append(new[0])
            computes.append(Compute(req, self.done[req], 1, new))
            self.done[req] += 1
        for req in list(self.prefilling):
            start = self.done[req]
            new = tuple(next(self.blocks) for _ in range(self.chunk // ENGINE_BLOCK))
            self.tables[req].extend(new)
            # a new request's first chunk: its table given whole, the first half of it loaded from kvwarm
            computes.append(Compute(req, start, self.chunk, new, replace=start == 0))
            if start == 0:
                loads.append((req, new[: len(new) // 2], len(new) // 2))
            saves.append((req, start // ENGINE_BLOCK, new, 1))
            self.done[req] = start + self.chunk
        for req in list(self.prefilling):
            if self.done.get(req, 0) >= self.context:  # prompt done: it decodes, the oldest decoder ends
                self.prefilling.remove(req)
                oldest = next(r for r in self.done if r not in self.prefilling and r != req)
                del self.done[oldest], self.tables[oldest]
                ended.append(oldest)
                fresh = f"r{next(self.names)}"
                self.done[fresh], self.tables[fresh] = 0, []
                self.prefilling.append(fresh)
        return computes, ended, loads, saves


def as_sent(ledger, computes: list[Compute]) -> tuple[list[Compute], dict]:
    """A step's requests as the scheduler sends them (``planning.computes_of``): the steady decodes apart, in
    bulk, after the others; the walking ledger, which takes no bulk, gets them one by one in that order."""
    steady = [c for c in computes if not c.replace and not c.new_blocks]
    others = [c for c in computes if c.replace or c.new_blocks]
    if not isinstance(ledger, BlockLedger):
        return others + steady, {}
    ids, starts, tokens = (tuple(col) for col in list(zip(*steady))[:3]) if steady else ((), (), ())
    return others, {"decodes": Decodes(ids, starts, tokens)}


def run_steps(ledger, work: Workload, steps: list) -> list[float]:
    """Each step's ledger time in ms, as the worker calls it."""
    times = []
    clock = time.perf_counter
    for computes, ended, loads, saves in steps:
        computes, bulk = as_sent(ledger, computes)
        t0 = clock()
        ledger.begin(computes, ended=ended, **bulk)
        for _, ids, ok in loads:
            ledger.loaded(ids, ok)
        ledger.computed()
        for req, first, ids, ratio in saves:
            ledger.vouched(req, first, ids, ratio)
        times.append((clock() - t0) * 1e3)
    return times


def one_run(make, requests: int, context: int, args: argparse.Namespace) -> tuple[float, float, float, int]:
    """Median, mean and slowest ms per step over the timed steps of one fresh ledger; the blocks it touched
    per step."""
    work = Workload(requests, context, prefills=args.prefills, chunk=args.chunk)
    steps = [work.step() for _ in range(args.warmup + args.steps)]
    ledger = make(ENGINE_BLOCK)
    ledger.begin(work.first)
    ledger.computed()
    run_steps(ledger, work, steps[: args.warmup])
    before = getattr(ledger, "visited", 0)
    times = run_steps(ledger, work, steps[args.warmup:])
    visited = (getattr(ledger, "visited", 0) - before) // args.steps
    return statistics.median(times), statistics.fmean(times), max(times), visited


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 steps, 3 repeats, no walking ledger")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="steps before the clock starts")
    ap.add_argument("--repeats", type=int, default=None, help="runs per shape (default 7)")
    ap.add_argument("--prefills", type=int, default=2, help="requests prefilling in each step")
    ap.add_argument("--chunk", type=int, default=512, help="tokens of each prefill chunk")
    ap.add_argument("--no-reference", action="store_true", help="skip the walking ledger (slow at 256 x 8k)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("ledger", __file__, argv)
    args.steps = args.steps or (100 if args.quick else 300)
    repeats = args.repeats or (3 if args.quick else 7)
    makers = {"incremental": BlockLedger}
    if not (args.quick or args.no_reference):
        from tests.store.engines.vllm.ledger_reference import ReferenceLedger
        makers["walking"] = ReferenceLedger
    results: dict[str, dict] = {}
    for requests, context in SHAPES:
        shape = f"{requests}x{context // 1024}k"
        row: dict = {"requests": requests, "context": context}
        for name, make in makers.items():
            got = [one_run(make, requests, context, args) for _ in range(1 if name == "walking" else repeats)]
            row[f"{name}_ms"] = round(statistics.median(g[0] for g in got), 4)
            if name == "incremental":
                # the mean and the slowest step include the steps where a request ends (its table is
                # dropped: O(its length), once) and a new one starts
                row["incremental_mean_ms"] = round(statistics.median(g[1] for g in got), 4)
                row["incremental_max_ms"] = round(statistics.median(g[2] for g in got), 4)
                row["blocks_touched_per_step"] = got[0][3]
        results[shape] = row
        print(f"{shape:>8}: incremental {row['incremental_ms']:.4f} ms/step (mean {row['incremental_mean_ms']:.4f}, "
              f"slowest {row['incremental_max_ms']:.4f})"
              + (f", walking {row['walking_ms']:.3f} ms/step" if "walking_ms" in row else "")
              + f"  ({row['blocks_touched_per_step']} blocks touched per step)", flush=True)
    targets = {f"ms_per_step_{shape}": {"value": row["incremental_ms"], "target": TARGET_MS,
                                        "met": row["incremental_ms"] <= TARGET_MS}
               for shape, row in results.items()}
    met = all(t["met"] for t in targets.values())
    print(f"target: <= {TARGET_MS} ms per step at every shape: {'MET' if met else 'NOT MET'}", flush=True)
    doc = {"bench": "ledger", "quick": args.quick, "engine_block": ENGINE_BLOCK, "steps": args.steps,
           "warmup": args.warmup, "repeats": repeats, "prefills": args.prefills, "chunk": args.chunk,
           "measured": "BlockLedger.begin + loaded + computed + vouched per step, as the worker calls them, on "
                       "steady steps: every running request decodes 1 token, --prefills requests prefill a "
                       "--chunk-token chunk (a new one's first chunk half loaded), the steady decodes told in bulk; "
                       "median of the timed steps, median of --repeats runs; 'walking' is the ledger before it was incremental (1 run)",
           "units": "ms per step", "results": results, "targets": targets}
    run.finish(doc, args.results, variant_of(args, partial=(args.steps, repeats, args.prefills, args.chunk)
                                             != (300, 7, 2, 512) and not args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
