"""Write-back uploads: one bounded queue over the node's S3 link, a block in S3 when its upload lands."""
from __future__ import annotations

import numpy as np

from forecasting.ingest.traces import from_chains
from forecasting.simulate.channels import FetchChannel, S3Link, drain
from forecasting.simulate.policies import make_node, restore_order
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import Node, NodeShape, TierCosts
from forecasting.simulate.uploads import UploadQueue
from store.cost import LoadCost, PrefillCost

COSTS = TierCosts(PrefillCost(1.0, 0.0), LoadCost(10.0), LoadCost(0.5), block_bytes=1.0)  # 2 s an upload or copy


def test_a_save_that_does_not_fit_is_dropped_whole_and_bytes_free_with_its_last_block() -> None:
    q = UploadQueue(1.0, S3Link(), max_bytes=3.0, save_bytes=1.0)
    assert q.submit(2, [1, 2], now=0.0) and q.queued_bytes == 2.0
    assert not q.submit(2, [3, 4], now=0.0) and q.dropped == 2  # 2 + 2 > 3: the product's queue_full
    got = drain([q], 1.0, ())
    assert [(b, t) for _, b, t in got] == [(1, 1.0)] and q.queued_bytes == 2.0  # the save waits for its last block
    drain([q], 2.0, ())
    assert q.queued_bytes == 0.0 and q.submit(3, [5, 6, 7], now=2.0)


def test_uploads_share_the_link_with_the_copies_from_s3() -> None:
    link = S3Link(1.0)
    up, fetch = UploadQueue(0.0, link), FetchChannel(0.0, link)
    up.submit(2, [1, 2], now=0.0)
    fetch.submit([3, 4], now=0.0)
    got = drain([up, fetch], 10.0, ())
    assert [t for _, _, t in got] == [1.0, 2.0, 3.0, 4.0]  # four blocks, one link second each, whoever sends them


def _node(shape: NodeShape, index: BlockIndex) -> Node:
    return Node(index, shape, COSTS, np.full(index.n_unique, 99, dtype=np.int64))


def test_a_block_is_in_s3_from_the_first_request_after_its_upload_lands() -> None:
    # 1-2 computed at 0 s; uploads of 2 s each land at 2 and 4 s; requests at 1, 3 and 5 s
    index = BlockIndex.build(from_chains([0.0, 1.0, 3.0, 5.0], [[1, 2], [7], [8], [9]]))
    node = _node(NodeShape(4, 8), index)
    node.land(0.0)
    node.serve(0)
    for i in (1, 2, 3):
        node.land(float(index.trace.timestamps_s[i]))
        node.serve(i)
    assert [int(node.stored[b]) for b in (0, 1)] == [2, 3]  # block 1 from the 3 s request, block 2 from 5 s
    assert node.uploads.uploaded >= 2
    # a queue too small for the save: nothing reaches S3, nor the node tier
    small = _node(NodeShape(4, 8, write_back_queue_bytes=1.0), index)
    small.land(0.0)
    small.serve(0)
    small.land(10.0)
    assert len(small.tier) == 0 and int(small.stored.min()) == 99 and small.uploads.dropped == 2


def test_reactive_store_waits_for_an_s3_hit_when_that_beats_recomputing() -> None:
    # S3 holds 1-2-3 (another node): 12 s of prefill (4 tokens a block), which 6 s of copies beat
    index = BlockIndex.build(from_chains([0.0], [[1, 2, 3]], block_tokens=4))
    stored = np.zeros(index.n_unique, dtype=np.int64)
    shape = NodeShape(4, 8, sync_timeout_s=100.0)
    rs = make_node("reactive-store", index, shape, COSTS, stored, np.arange(1), ())
    kv = make_node("kvwarm", index, shape, COSTS, stored, np.arange(1), ())
    got, background = rs.serve(np.arange(1))[0], kv.serve(np.arange(1))[0]
    assert got.s3 == 3 and got.load_s > 6.0 and got.ttft_s < background.ttft_s
    assert background.s3 == 0 and len(kv.node.fetch) == 3  # kvwarm's loader (background): a miss, copied for next time


def test_restore_replays_the_last_hours_access_log_most_recent_first() -> None:
    index = BlockIndex.build(from_chains([0.0, 4000.0, 5000.0], [[1, 2], [3, 4], [3, 5]]))
    order = index.original[restore_order(index, 6000.0)].tolist()
    assert order == [3, 5, 4]  # the 5000 s request first, root first; 1-2 are older than an hour
