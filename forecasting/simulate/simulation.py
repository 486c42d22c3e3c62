"""The replay shaped like the deployment: policies side by side through restarts, replacements and scale-outs.

A :class:`Scenario` says what happens to the node under test:

- ``steady``: one node serves the whole trace;
- ``restart`` at ``T``: the engine restarts: vLLM's cache is emptied, the node tier survives;
- ``replacement`` at ``T``: a new node, with an empty node tier, takes all the traffic;
- ``scale-out`` at ``T``: a new node takes a random ``share`` of the requests.

S3 is shared by the fleet: with write-back, a block is there from the request after its
first use anywhere (:func:`forecasting.simulate.policies.written_back`). Every policy
(:mod:`forecasting.simulate.policies`) runs on the same :class:`Deployment`, and each
event's window is measured against the same policy without the event (the reference:
the node that kept running, or for a scale-out a node that had its share from the start).
:func:`simulate` returns one :class:`SimResult` per scenario; :func:`plot` draws it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from forecasting.simulate.metrics import PolicyResult
from forecasting.simulate.policies import (
    POLICIES,
    Planner,
    PlanTick,
    kvwarm_plans,
    prefill_blocks,
    prefill_gpu_s,
    stored_with_prefill,
    written_back,
)
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.runs import SCENARIOS, Scenario, run_oracle, run_policy, window_rows
from forecasting.simulate.tiers import NODE_TIER, S3_LINK_BYTES_PER_S, S3_STREAM, NodeShape, TierCosts
from store.config import KvCacheConfig, LoaderConfig
from store.cost import LoadCost, PrefillCost
from store.errors import BadInputError
from store.format.header import Layout
from store.format.payload import kv_bytes_per_token
from store.format.precision import Precision

#: the engine the defaults describe: an 8B GQA model (Llama 3 8B: 32 layers, 8 KV heads of 128) on one H200
EIGHT_B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
#: what a token takes in vLLM's cache for that model (bf16 keys and values)
ENGINE_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: vLLM's KV cache on an H200: its 141 GB less the 16 GB of weights, activations and headroom
GPU_KV_BYTES = 100e9
#: kvwarm's node tier: 1 TB of the node's NVMe
NODE_BYTES = 1e12


def stored_bytes_per_token(block_tokens: int, precision: Precision | None = None) -> float:
    """What a token of the 8B geometry takes in kvwarm's store (default precision: FP8, layer 0 in bf16,
    fp32 scales), in blocks of ``block_tokens`` (the per-block scales make it depend on the block size)."""
    return kv_bytes_per_token(Layout(**EIGHT_B, block_size=block_tokens), precision or KvCacheConfig().precision())


@dataclass(frozen=True)
class Deployment:
    """What every policy runs on: the node's shape and the costs of its levels."""

    shape: NodeShape
    costs: TierCosts

    @classmethod
    def default(cls, block_tokens: int, *, gpu_kv_bytes: float = GPU_KV_BYTES, node_bytes: float = NODE_BYTES,
                write_back: bool = True, loader: LoaderConfig | None = None, prefill: PrefillCost | None = None,
                stored_per_token: float | None = None, s3_bytes_per_s: float = S3_LINK_BYTES_PER_S,
                s3_stream: LoadCost = S3_STREAM) -> Deployment:
        """The 8B model on an H200 with kvwarm's node tier and S3, at the calibrated costs.

        vLLM's cache holds ``gpu_kv_bytes`` of bf16 KV, the node tier ``node_bytes`` of
        stored blocks (``stored_per_token`` bytes a token, default the 8B geometry's in
        kvwarm's precision). The loader's settings (default: the config's ``loader``
        section) give the fetch mode, the plan prefetch's streams (``prefetch_streams``) and
        the background fetches' (``fetch_workers``); both share the node's S3 link of
        ``s3_bytes_per_s`` (default :data:`~forecasting.simulate.tiers.S3_LINK_BYTES_PER_S`: AWS's
        per-request rate at the 8 prefetch streams), each stream copying at ``s3_stream``'s
        rate (default :data:`~forecasting.simulate.tiers.S3_STREAM`, AWS's; this host's
        SeaweedFS: :data:`~forecasting.simulate.tiers.HOST_S3_STREAM`). Write-back uploads
        run on the loader's ``write_back_streams`` and share the link; their copy queue holds
        the loader's ``write_back_queue_bytes`` of the engine's bf16 copies (a block of
        ``block_tokens`` takes ``block_tokens *`` :data:`ENGINE_KV_BYTES_PER_TOKEN`), and as
        many stored bytes again wait for upload.

        Raises:
            BadInputError: a capacity that holds no block.
        """
        loader = loader or LoaderConfig()
        per_token = stored_bytes_per_token(block_tokens) if stored_per_token is None else stored_per_token
        block_bytes = per_token * block_tokens
        gpu = int(gpu_kv_bytes // (block_tokens * ENGINE_KV_BYTES_PER_TOKEN))
        node = int(node_bytes // block_bytes)
        if gpu < 1 or node < 1:
            raise BadInputError(f"the engine's cache ({gpu_kv_bytes:g} bytes) and the node tier ({node_bytes:g} bytes) "
                                f"must each hold at least one block of {block_tokens} tokens")
        shape = NodeShape(gpu, node, write_back=write_back, fetch_mode=loader.fetch_mode,
                          sync_timeout_s=loader.sync_fetch_timeout_s,
                          write_back_queue_bytes=float(loader.write_back_queue_bytes))
        costs = TierCosts(prefill or PrefillCost(), NODE_TIER, s3_stream, block_bytes,
                          prefetch_streams=loader.prefetch_streams, fetch_streams=loader.fetch_workers,
                          s3_bytes_per_s=s3_bytes_per_s, save_block_bytes=block_tokens * ENGINE_KV_BYTES_PER_TOKEN,
                          upload_streams=loader.write_back_streams)
        return cls(shape, costs)


@dataclass(frozen=True)
class SimResult:
    """One scenario: a row per policy, and each policy's no-event reference (none for steady)."""

    scenario: Scenario
    window: tuple[float, float]
    rows: tuple[PolicyResult, ...]
    reference: dict[str, PolicyResult]

    def row(self, policy: str) -> PolicyResult:
        for r in self.rows:
            if r.policy == policy:
                return r
        raise KeyError(f"no row for policy {policy!r}; have {[r.policy for r in self.rows]}")

    def to_json(self) -> dict[str, Any]:
        return {"scenario": asdict(self.scenario), "window_s": list(self.window), "rows": [asdict(r) for r in self.rows],
                "reference": {k: asdict(v) for k, v in self.reference.items()}}

    def table(self) -> str:
        """A plain-text table, one line per policy (rates exclude each request's first block)."""
        head = (f"{'policy':<15}{'hit%':>6}{'excl0%':>7}{'vllm%':>6}{'node%':>6}{'s3%':>5}{'1st-min%':>9}"
                f"{'no-event':>9}{'TTFT ms':>8}{'p99 ms':>8}{'1st-min':>8}{'prefill s':>10}{'prec%':>6}{'rec%':>6}")
        lines = [head]
        for r in self.rows:
            ref = self.reference.get(r.policy)
            pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
            lines.append(
                f"{r.policy:<15}{100 * r.hit_rate:>6.1f}{100 * r.hit_rate_excl_root:>7.1f}"
                f"{100 * r.level_excl_root['gpu']:>6.1f}{100 * r.level_excl_root['node']:>6.1f}"
                f"{100 * r.level_excl_root['s3']:>5.1f}{100 * r.first_minute_hit_rate_excl_root:>9.1f}"
                f"{pct(ref.first_minute_hit_rate_excl_root if ref else None):>9}{1e3 * r.ttft_mean_s:>8.1f}"
                f"{1e3 * r.ttft_p99_s:>8.0f}{1e3 * r.first_minute_ttft_mean_s:>8.1f}{r.prefill_gpu_s:>10.1f}"
                f"{pct(r.warmup_precision):>6}{pct(r.warmup_recall):>6}")
        return "\n".join(lines)


def simulate(index: BlockIndex, deployment: Deployment, scenarios: Sequence[Scenario],
             policies: Sequence[str] = POLICIES, *, planner: Planner | None = None, references: bool = True,
             ticks: Sequence[PlanTick] | None = None) -> list[SimResult]:
    """Run every policy through every scenario (see the module docstring).

    The node that serves the whole trace is run once per policy: it is the steady run,
    the no-event reference of restarts and replacements, the node a replacement follows
    (whose uploads are what S3 holds at the event), and each restart forks it.
    ``references=False`` skips the no-event runs (tuning); ``ticks`` are kvwarm's plans when
    already made (:func:`kvwarm_plans` with the same planner), so several deployments can
    share them.

    Raises:
        BadInputError: an unknown policy or scenario, an event outside the trace, or
            ``kvwarm`` without a ``planner``.
    """
    for p in policies:
        if p not in POLICIES:
            raise BadInputError(f"unknown policy {p!r}; choose one of {', '.join(POLICIES)}")
    if "kvwarm" in policies and planner is None:
        raise BadInputError("the kvwarm policy needs the pipeline's planner (its plans at its cadence)")
    shape, costs = deployment.shape, deployment.costs
    ts = index.trace.timestamps_s
    windows = [window_rows(index, sc) for sc in scenarios]
    last = max((float(ts[int(w[-1])]) for w, _ in windows if len(w)), default=0.0)
    fleet = written_back(index) if shape.write_back else np.full(index.n_unique, len(ts) + 1, dtype=np.int64)
    prefilled, done_s = np.zeros(0, dtype=np.int64), float("inf")
    plans: list[PlanTick] = []
    if "kvwarm" in policies:
        assert planner is not None
        prefilled, done_s = prefill_blocks(index, planner.base, planner.origin)
        plans = list(ticks) if ticks is not None else kvwarm_plans(
            index, planner, stored_with_prefill(index, fleet, prefilled, done_s), last)
    gpu_s = prefill_gpu_s(index, prefilled, fleet, done_s, planner.cost.prefill) if len(prefilled) else 0.0
    never = np.full(index.n_unique, len(ts) + 1, dtype=np.int64)
    results: dict[tuple[int, str], PolicyResult] = {}
    refs: dict[tuple[int, str], PolicyResult] = {}
    s3: dict[int, np.ndarray] = {}  # per scenario, the earliest any store policy's node found each block in S3
    for policy in sorted(policies, key=lambda p: p == "oracle"):  # the oracle last: it reads their S3
        if policy == "oracle":  # the bound's S3: the earliest of any policy's, with the prefill job's
            run_oracle(index, shape, costs, stored_with_prefill(index, fleet, prefilled, done_s), scenarios, windows,
                       results, refs, references, s3 if len(s3) else None)
            continue
        kv = policy == "kvwarm"
        own = stored_with_prefill(index, never, prefilled, done_s) if kv else never
        run_policy(policy, index, shape, costs, own, plans, scenarios, windows, gpu_s if kv else 0.0, results, refs,
                   references, s3)
    out = []
    for k, sc in enumerate(scenarios):
        window = (0.0, float(ts[-1])) if sc.kind == "steady" else (sc.at_s, sc.at_s + sc.window_s)
        out.append(SimResult(sc, window, tuple(results[(k, p)] for p in policies),
                             {p: refs[(k, p)] for p in policies if (k, p) in refs}))
    return out


def plot(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Per-minute hit rates (excluding the root block) of every policy, and kvwarm's no-event reference."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'kvwarm[pipeline]' (or matplotlib)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref = result.reference.get("kvwarm") or next(iter(result.reference.values()), None)
    if ref is not None and ref.per_bucket:
        xs, ys = zip(*ref.per_bucket)
        ax.plot(xs, [100 * y for y in ys], "k--", label=f"no event ({ref.policy})")
    for r in result.rows:
        if r.per_bucket:
            xs, ys = zip(*r.per_bucket)
            ax.plot(xs, [100 * y for y in ys], marker=".", label=r.policy)
    sc = result.scenario
    ax.set_xlabel("minutes since the start of the trace" if sc.kind == "steady" else f"minutes since the {sc.kind} "
                  f"at {sc.at_s:g} s")
    ax.set_ylabel("token hit rate excluding block 0 (%)")
    ax.set_title(title or sc.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
