"""The live replay's pure parts: token ids per hash id, the slice of a trace, its log rows, and the figures."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench.lib.live_figures import fit_prefill, lmcache_costs, phase_figures, saved_per_request
from bench.lib.live_trace import (
    SliceSpec,
    block_token_ids,
    conversation_key,
    event_time,
    log_rows,
    prompt_token_ids,
    slice_trace,
)
from bench.live_replay import TRACE
from forecasting.ingest.log_trace import trace_from_requests
from forecasting.ingest.traces import read_mooncake


def test_equal_hash_ids_give_equal_tokens_and_chained_prefixes_are_equal_token_prefixes() -> None:
    a = block_token_ids(7, 512, 4096)
    assert np.array_equal(a, block_token_ids(7, 512, 4096))
    assert not np.array_equal(a, block_token_ids(8, 512, 4096))
    assert not np.array_equal(a, block_token_ids(7, 512, 4096, seed=1))
    assert a.min() >= 1 and a.max() < 4096  # token 0 (the tiny model's BOS/EOS) never drawn
    p = prompt_token_ids([0, 5, 9], 1300, 512, 4096)
    q = prompt_token_ids([0, 5, 11, 12], 1800, 512, 4096)
    assert len(p) == 1300 and len(q) == 1800
    assert p[:1024] == q[:1024] and p[1024:1300] != q[1024:1300]  # shared up to the chains' common blocks
    with pytest.raises(ValueError):
        prompt_token_ids([0], 513, 512, 4096)


def test_the_slice_keeps_whole_conversations_cuts_prompts_and_compresses_time() -> None:
    trace = read_mooncake(TRACE)
    every = slice_trace(trace, SliceSpec(start_s=60.0, end_s=180.0))
    sample = slice_trace(trace, SliceSpec(start_s=60.0, end_s=180.0, every=4, max_blocks=3, max_tokens=1400,
                                          speedup=4.0))
    assert every[0].at_s == 0.0 and all(60 <= trace.timestamps_s[r.row] < 180 for r in every)
    assert 0.15 * len(every) < len(sample) < 0.4 * len(every)
    kept = {conversation_key(r.hash_ids, r.row) for r in sample}
    # every request of a kept conversation is in the sample, none of the others
    assert [r.row for r in every if conversation_key(r.hash_ids, r.row) in kept] == [r.row for r in sample]
    first = trace.timestamps_s[sample[0].row]
    for r in sample:
        assert r.at_s == pytest.approx((trace.timestamps_s[r.row] - first) / 4.0)
        full = tuple(trace.block_ids[trace.offsets[r.row]:trace.offsets[r.row + 1]])
        assert r.hash_ids == full[:3] and r.n_tokens == min(int(trace.input_tokens[r.row]), 1400)
    assert event_time(sample, 0.5) == pytest.approx(sample[-1].at_s / 2)
    assert slice_trace(trace, SliceSpec(every=4)) == slice_trace(trace, SliceSpec(every=4))  # deterministic


def test_log_rows_replay_as_the_same_shared_prefixes() -> None:
    trace = read_mooncake(TRACE)
    sample = slice_trace(trace, SliceSpec(end_s=120.0, every=6, max_blocks=4))
    prompts = [prompt_token_ids(r.hash_ids, r.n_tokens, 512, 4096) for r in sample]
    rows = log_rows(sample, prompts, tenant="t", model="m", origin=pd.Timestamp("2026-01-01"))
    assert list(rows["prompt_tokens"]) == [len(p) for p in prompts]
    sim = trace_from_requests(rows, block_size=256)
    assert len(sim) == len(sample)
    # a 256-token block of the replay was seen before exactly when the same half of the same
    # 512-token hash id was (Mooncake's ids are chained: an equal id is an equal prefix)
    seen_half, seen_block = set(), set()
    for i, r in enumerate(sample):
        blocks = sim.block_ids[sim.offsets[i]:sim.offsets[i + 1]]
        assert len(blocks) == r.n_tokens // 256
        halves = [(r.hash_ids[j // 2], j % 2) for j in range(len(blocks))]
        assert [int(b) in seen_block for b in blocks] == [h in seen_half for h in halves]
        seen_block.update(int(b) for b in blocks)
        seen_half.update(halves)
    assert seen_block and len(seen_block) < sum(len(p) // 256 for p in prompts)  # some blocks are shared


def rec(i: str, at: float, ttft: float, *, error: str | None = None, ext: int = 0) -> dict:
    return {"id": i, "at_s": at, "ttft_s": ttft, "first_token_s": at + ttft, "done_s": at + ttft,
            "error": error, "prompt_tokens": 1000, "external_tokens": ext, "local_cached_tokens": 0}


def test_figures_pair_requests_by_id_and_count_failures() -> None:
    base = [rec("a", 0, 0.5), rec("b", 1, 0.3), rec("c", 2, 0.4)]
    other = [rec("a", 0, 0.2, ext=512), rec("b", 1, 0.3), rec("c", 2, 9.0, error="finish_reason='abort'")]
    assert saved_per_request(base, other) == pytest.approx(0.15)  # a and b; c failed
    f = phase_figures(other)
    assert f["failed"] == 1 and f["requests"] == 3 and f["external_tokens"] == 512
    assert f["ttft_mean_s"] == pytest.approx(0.25)


def test_lmcache_costs_read_its_servers_log() -> None:
    log = "\n".join([
        "[..] LMCache INFO: Stored 3840 tokens in 0.076 seconds (engine_driven_transfer.py:447)",
        "[..] LMCache INFO: Prefetch request completed (L1+L2): 2/15 retained keys (0 L1, 2 L2) in 14.6 ms (x)",
        "[..] LMCache INFO: Retrieved 512 tokens in 0.006 seconds (engine_driven_transfer.py:514)",
        "[..] LMCache INFO: Prefetch request completed (L1+L2): 3/3 retained keys (3 L1, 0 L2) in 0.4 ms (x)",
        "[..] LMCache INFO: Prefetch request completed (L1+L2): 15/15 retained keys (0 L1, 15 L2) in 33.2 ms (x)",
        "[..] LMCache INFO: Retrieved 3328 tokens in 0.013 seconds (engine_driven_transfer.py:514)"])
    c = lmcache_costs(log)
    assert c["l2_keys"] == 17 and c["l2_prefetches"] == 2 and c["l2_s"] == pytest.approx(0.0478)
    assert c["retrieved_tokens"] == 3840 and c["retrieved_s"] == pytest.approx(0.019)
    assert c["stored_tokens"] == 3840
    assert lmcache_costs("nothing here")["l2_keys"] == 0


def test_the_prefill_fit_recovers_its_terms() -> None:
    n = np.array([256, 1024, 2048, 3072, 4080])
    t = 0.005 + 2e-6 * n + 8e-9 * n * (n + 1) / 2
    c0, a, b = fit_prefill(list(zip(n.tolist(), t.tolist())))
    assert c0 == pytest.approx(0.005, rel=1e-6) and a == pytest.approx(2e-6, rel=1e-6)
    assert b == pytest.approx(8e-9, rel=1e-6)
