"""The oracle is an upper bound: no deployable policy beats its mean TTFT after any event, at any S3 link.

``belady`` changes vLLM's own eviction (no store can): it is a ceiling of eviction, outside the bound."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import from_chains, read_mooncake
from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
from forecasting.simulate.oracle import oracle_served
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import Deployment, Scenario, simulate
from forecasting.simulate.tiers import S3_LINK_BYTES_PER_S

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"
LINKS = (1e9 / 8, S3_LINK_BYTES_PER_S, 100e9 / 8)
POLICIES = ("vllm", "reactive-store", "kvwarm", "restore", "oracle", "belady")


def synthetic(seed: int = 3) -> BlockIndex:
    """Three-turn conversations a minute apart over 8 system prompts, 512-token blocks, 20 minutes."""
    rng = np.random.default_rng(seed)
    times, chains, nxt = [], [], 10_000
    for c in range(240):
        start = float(rng.uniform(0, 1080))
        chain = [1 + 100 * int(rng.integers(8)) + j for j in range(int(rng.integers(2, 6)))]
        for turn in range(3):
            chain = chain + list(range(nxt, nxt + int(rng.integers(1, 5))))
            nxt += 10
            times.append(start + 60.0 * turn + float(rng.uniform(0, 5)))
            chains.append(chain)
    order = np.argsort(times, kind="stable")
    return BlockIndex.build(from_chains([times[i] for i in order], [chains[i] for i in order], block_tokens=512))


@pytest.fixture(scope="module", params=["mooncake-head", "synthetic"])
def trace_index(request: pytest.FixtureRequest) -> BlockIndex:
    return BlockIndex.build(read_mooncake(MOONCAKE)) if request.param == "mooncake-head" else synthetic()


@pytest.mark.parametrize("link", LINKS, ids=["1gbps", "default", "100gbps"])
def test_no_policy_beats_the_oracle_on_any_event(trace_index: BlockIndex, link: float) -> None:
    tr = trace_index.trace
    # a small node, so that the engine's cache and the node tier both fill on these short traces
    deployment = Deployment.default(512, gpu_kv_bytes=40 * 512 * 131072, node_bytes=400 * 34604992,
                                    s3_bytes_per_s=link)
    planner = planner_for(tr, requests_from_trace(tr), retain_spec(deployment), deployment, cadence_s=120.0)
    at = [f * tr.duration_s for f in (0.3, 0.6)]
    scenarios = [Scenario(kind, a, window_s=240.0, share=0.4) for a in at
                 for kind in ("restart", "replacement", "scale-out")] + [Scenario("steady")]
    for res in simulate(trace_index, deployment, scenarios, POLICIES, planner=planner):
        oracle = res.row("oracle").ttft_mean_s
        rows = [r for r in res.rows if r.policy != "belady"]
        for r in rows:
            assert oracle <= r.ttft_mean_s + 1e-12, (res.scenario.name, r.policy, oracle, r.ttft_mean_s)
        # the bound holds per request for the window's first minute too
        assert res.row("oracle").first_minute_ttft_mean_s <= min(r.first_minute_ttft_mean_s for r in rows) + 1e-12


def test_the_bound_charges_what_the_link_cannot_have_carried() -> None:
    # a new node at 0 s; request at 1 s uses 4 blocks S3 holds (the fleet wrote them before); the link
    # carries one block a second (and the streams faster), so by 1 s one came over and three must be waited for
    index = BlockIndex.build(from_chains([0.0, 1.0], [[9], [1, 2, 3, 4]], block_tokens=512))
    d = Deployment.default(512, s3_bytes_per_s=34604992.0)
    stored = np.zeros(index.n_unique, dtype=np.int64)
    rows = np.array([1])
    got = oracle_served(index, d.costs, d.shape.gpu_blocks, rows, history=rows, engine=rows, stored=stored,
                        start_s=0.0)[0]
    later = oracle_served(index, d.costs, d.shape.gpu_blocks, rows, history=rows, engine=rows, stored=stored,
                          start_s=-10.0)[0]  # ten seconds of link: every block could be on the node
    assert later.gpu == 0 and later.node + later.s3 == 4 and later.load_s == pytest.approx(
        float(d.costs.local.seconds(4 * d.costs.block_bytes, 4)))
    assert got.ttft_s > later.ttft_s  # the same blocks cost the wait for the three the link could not carry
    never = np.full(index.n_unique, 99, dtype=np.int64)
    none = oracle_served(index, d.costs, d.shape.gpu_blocks, rows, history=rows, engine=rows, stored=never,
                         start_s=-10.0)[0]
    assert none.node + none.s3 == 0 and none.load_s == 0.0  # nothing in S3, nothing served before: all prefill
