"""Write-back uploads: a save's leading blocks that fit, on several streams over the node's S3 link."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from forecasting.ingest.traces import from_chains
from forecasting.simulate.channels import FetchChannel, S3Link, drain
from forecasting.simulate.policies import make_node, restore_order
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import Node, NodeShape, TierCosts
from forecasting.simulate.uploads import UploadQueue
from store.cost import LoadCost, PrefillCost

COSTS = TierCosts(PrefillCost(1.0, 0.0), LoadCost(10.0), LoadCost(0.5), block_bytes=1.0)  # 2 s an upload or copy


def test_a_save_keeps_its_leading_blocks_that_fit_and_what_finds_no_upload_room_stays_on_nvme() -> None:
    q = UploadQueue(1.0, S3Link(), max_bytes=3.0, save_bytes=1.0, block_bytes=1.0, streams=1)
    assert q.submit([1, 2], (), now=0.0) == 2 and q.nvme_only == 0  # both in the upload stage at once
    assert q.submit([3, 4, 5], (), now=0.0) == 3 and q.nvme_only == 2  # one fits the stage; two on NVMe only
    assert q.submit([6, 7, 8, 9], (), now=0.0) == 3 and q.dropped == 1  # one save's copies: three blocks at most
    assert q.nvme_only == 5 and q.queued_bytes == 0.0  # the writer never waits: no copy is left waiting
    got = drain([q], 1.0, ())
    assert [(b, t) for _, b, t in got] == [(1, 1.0)]
    assert q.submit([10, 11, 12], {11}, now=1.0) == 3  # 11 is on the node: not uploaded; 10 fills the stage
    got = drain([q], 100.0, ())
    assert [b for _, b, _ in got] == [2, 3, 10] and q.uploaded == 4 and q.nvme_only == 6


def test_uploads_run_on_their_streams_at_once_within_the_link() -> None:
    q = UploadQueue(4.0, S3Link(1.0), save_bytes=1.0, block_bytes=1.0, streams=3)
    assert q.submit([1, 2, 3, 4, 5, 6], (), now=0.0) == 6
    got = drain([q], 100.0, ())
    # three PUTs of 4 s at once (the link, 1 s a block, carries them within that), then three more
    assert [t for _, _, t in got] == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0]
    busy = UploadQueue(2.0, S3Link(1.0), save_bytes=1.0, block_bytes=1.0, streams=4)
    busy.submit([1, 2, 3, 4, 5, 6], (), now=0.0)
    assert [t for _, _, t in drain([busy], 100.0, ())] == [2.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # four streams: the link binds
    one = UploadQueue(4.0, S3Link(1.0), save_bytes=1.0, block_bytes=1.0, streams=1)
    one.submit([1, 2, 3], (), now=0.0)
    assert [t for _, _, t in drain([one], 100.0, ())] == [4.0, 8.0, 12.0]  # one stream: one PUT at a time
    fast = UploadQueue(0.0, S3Link(1.0), streams=8)
    fast.submit([1, 2, 3], (), now=0.0)
    assert [t for _, _, t in drain([fast], 100.0, ())] == [1.0, 2.0, 3.0]  # however many streams, the link bounds them
    small = UploadQueue(4.0, S3Link(), max_bytes=2.0, save_bytes=0.5, block_bytes=1.0, streams=4)
    assert small.submit([1, 2, 3], (), now=0.0) == 3
    # the upload stage holds two blocks: the third stays on NVMe only
    assert [t for _, _, t in drain([small], 100.0, ())] == [4.0, 4.0] and small.nvme_only == 1


def test_uploads_share_the_link_with_the_copies_from_s3() -> None:
    link = S3Link(1.0)
    up, fetch = UploadQueue(0.0, link), FetchChannel(0.0, link)
    up.submit([1, 2], (), now=0.0)
    fetch.submit([3, 4], now=0.0)
    got = drain([up, fetch], 10.0, ())
    assert [t for _, _, t in got] == [1.0, 2.0, 3.0, 4.0]  # four blocks, one link second each, whoever sends them


def _node(shape: NodeShape, index: BlockIndex, costs: TierCosts = COSTS) -> Node:
    return Node(index, shape, costs, np.full(index.n_unique, 99, dtype=np.int64))


def test_a_block_is_in_s3_from_the_first_request_after_its_upload_lands() -> None:
    # 1-2 computed at 0 s; requests at 1, 3 and 5 s; uploads of 2 s each
    index = BlockIndex.build(from_chains([0.0, 1.0, 3.0, 5.0], [[1, 2], [7], [8], [9]]))
    for streams, found in ((1, [2, 3]), (2, [2, 2])):  # one stream: they land at 2 and 4 s; two: both at 2 s
        node = _node(NodeShape(4, 8), index, replace(COSTS, upload_streams=streams))
        node.land(0.0)
        node.serve(0)
        for i in (1, 2, 3):
            node.land(float(index.trace.timestamps_s[i]))
            node.serve(i)
        assert [int(node.stored[b]) for b in (0, 1)] == found  # from the 3 s request (or the 5 s one)
        assert node.uploads.uploaded >= 2
    # a queue too small for the whole save: its root block reaches S3 and the node tier, the tail neither
    small = _node(NodeShape(4, 8, write_back_queue_bytes=1.0), index)
    small.land(0.0)
    small.serve(0)
    small.land(10.0)
    assert len(small.tier) == 1 and 0 in small.tier and small.uploads.dropped == 1
    assert [int(small.stored[b]) for b in (0, 1)] == [2, 99]  # the root landed at 2 s; the tail never


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
