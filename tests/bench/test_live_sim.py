"""The live replay's plan at the event and the simulator's: the same planner on the same slice, the same plan."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lib.live_engines import kvwarm_config, stored_bytes_per_token
from bench.lib.live_figures import BLOCK, ORIGIN, TENANT
from bench.lib.live_sim import make_live_plan, simulated_plan
from bench.lib.live_trace import LiveRequest, event_time, log_rows, prompt_token_ids
from forecasting.ingest.log_trace import trace_from_requests
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import ENGINE_KV_BYTES_PER_TOKEN, Deployment
from prefill.models import resolve
from store.cost import PrefillCost

#: the prefill cost of the live record's fit (kvwarm-ref on this CPU)
PREFILL = PrefillCost(1.65e-4, 1.14e-7)
NODE_BYTES = float(64 << 30)
HASH_TOKENS = 512  # Mooncake's tokens per hash id


def _slice(vocab: int) -> tuple[list[LiveRequest], list[list[int]]]:
    """Three conversations of growing prompts on one shared system block, turns interleaved."""
    reqs = []
    for turn in range(4):
        for conv in range(3):
            ids = (0,) + tuple(100 * (conv + 1) + k for k in range(turn + 2))
            reqs.append(LiveRequest(10.0 * turn + 2.0 * conv, len(reqs), ids, HASH_TOKENS * len(ids) - 100, 1))
    return reqs, [prompt_token_ids(r.hash_ids, r.n_tokens, HASH_TOKENS, vocab) for r in reqs]


@pytest.mark.parametrize("served", ["kvwarm-tiny", "kvwarm-ref"])
def test_the_live_plan_at_the_event_is_the_simulators(tiny: object, tmp_path: Path, served: str) -> None:
    model_dir = resolve("kvwarm-tiny")  # built by ``tiny``; its identity keys the live plan
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    reqs, prompts = _slice(vocab)
    # the rows carry the served model's name, as the bench logs them (--model)
    rows = log_rows(reqs, prompts, tenant=TENANT, model=served, origin=ORIGIN)
    event = event_time(reqs, 0.6)
    cfg = kvwarm_config(tmp_path / "a.yaml", nvme=tmp_path / "nvme", endpoint="http://127.0.0.1:1", node_id="a",
                        speedup=1.0)
    per_token = stored_bytes_per_token(model_dir, cfg)
    live = make_live_plan(rows, event, model_dir=model_dir, config_path=cfg, prefill=PREFILL, per_token=per_token,
                          node_bytes=NODE_BYTES)

    index = BlockIndex.build(trace_from_requests(rows, block_size=BLOCK))
    dep = Deployment.default(BLOCK, gpu_kv_bytes=(1 << 20) * ENGINE_KV_BYTES_PER_TOKEN, node_bytes=NODE_BYTES,
                             prefill=PREFILL, stored_per_token=per_token)
    _, ticks = simulated_plan(rows, event, index, dep, NODE_BYTES)
    (tick,) = ticks
    sim = tick.plan

    before = sum(r.at_s < event for r in reqs)
    assert live.extra["requests"] == sim.extra["requests"] == before
    assert live.entries and live.model == served
    assert live.as_of == sim.as_of
    assert live.extra["retain_blocks"] == sim.extra["retain_blocks"] > 0
    # the same prefixes, in the same order, with the same expected uses; only their keys differ
    # (the model's key root live, the simulator's own root)
    assert [e.token_ids for e in live.entries] == [e.token_ids for e in sim.entries]
    assert [e.action for e in live.entries] == [e.action for e in sim.entries]
    assert [e.expected_hits for e in live.entries] == pytest.approx([e.expected_hits for e in sim.entries])
    assert [e.urgency for e in live.entries] == pytest.approx([e.urgency for e in sim.entries])
