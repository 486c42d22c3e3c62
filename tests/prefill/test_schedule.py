"""The segment tree: every missing block computed once, parents before children, batches sane."""
from __future__ import annotations

from prefill.schedule import TOKEN_UNITS, Batch, PrefixJob, build_segments, plan_batches, split
from store.identity.keys import block_chain
from tests.store.factories import ACME, make_root

BS = 4


def job(tokens, stored=0, order=0, ttl=100.0):
    root = make_root(block_size=BS)
    return PrefixJob(tenant=ACME.name, root=root, blocks=tuple(block_chain(root, tokens)), stored=stored,
                     ttl_s=ttl, order=order)


SYSTEM = list(range(100, 112))  # three blocks


def test_shared_system_prompt_is_one_segment_with_a_child_per_prompt():
    jobs = [job(SYSTEM + [i] * 8, order=i) for i in range(10)]
    segs = build_segments(jobs)
    roots = [s for s in segs.values() if s.parent is None]
    assert len(roots) == 1 and len(roots[0].blocks) == 3
    kids = [segs[c] for c in roots[0].children]
    assert len(kids) == 10 and all(len(k.blocks) == 2 and k.start == 3 for k in kids)
    # every block of every job appears in exactly one segment
    all_blocks = [b.key for s in segs.values() for b in s.blocks]
    assert len(all_blocks) == len(set(all_blocks)) == len({b.key for j in jobs for b in j.blocks})


def test_stored_blocks_are_not_recomputed_and_become_the_past():
    jobs = [job(SYSTEM + [7] * 8, stored=3)]
    (seg,) = build_segments(jobs).values()
    assert seg.start == 3 and [b.index for b in seg.blocks] == [3, 4]
    assert [b.index for b in seg.stored_prefix] == [0, 1, 2]
    assert seg.past_tokens == 3 * BS


def test_fully_stored_prefix_needs_nothing():
    assert build_segments([job(SYSTEM, stored=3)]) == {}


def test_ttl_and_order_cover_every_prefix_through_a_block():
    jobs = [job(SYSTEM + [1] * 4, order=5, ttl=10.0), job(SYSTEM + [2] * 4, order=2, ttl=99.0)]
    segs = build_segments(jobs)
    trunk = next(s for s in segs.values() if s.parent is None)
    assert trunk.ttl_s == 99.0 and trunk.order == 2


def test_inconsistent_probes_still_compute_each_block_once_in_order():
    # job B's probe saw the first 3 blocks stored, job A's (later in the list) did not
    b = job(SYSTEM + [5] * 4, stored=3)
    a = job(SYSTEM + [5] * 4, stored=0)
    segs = build_segments([b, a])
    keys = [blk.key for s in segs.values() for blk in s.blocks]
    assert len(keys) == len(set(keys)) == 4
    (root,) = [s for s in segs.values() if s.parent is None]
    assert root.start == 0 and root.stored_prefix == ()


def test_batches_share_a_past_length_and_respect_the_budget():
    jobs = [job(SYSTEM + [i] * (4 * (1 + i % 3)), order=i) for i in range(9)]
    segs = build_segments(jobs)
    trunk = next(s for s in segs.values() if s.parent is None)
    batches = plan_batches(segs, trunk.children, max_batch_tokens=24, max_batch_size=8)
    seen = [sid for b in batches for sid in b.segments]
    assert sorted(seen) == sorted(trunk.children)
    for b in batches:
        assert {segs[s].past_tokens for s in b.segments} == {b.past_tokens}
        assert b.padded_tokens <= 24 or len(b.segments) == 1
    halves = split(batches[0], segs) if len(batches[0].segments) > 1 else []
    assert sum(len(h.segments) for h in halves) in (0, len(batches[0].segments))


def test_batches_run_the_most_valuable_prefixes_first():
    jobs = [job([i] * 8, order=10 - i) for i in range(4)]
    segs = build_segments(jobs)
    batches = plan_batches(segs, list(segs), max_batch_tokens=8, max_batch_size=1)
    orders = [segs[b.segments[0]].order for b in batches]
    assert orders == sorted(orders)


def test_a_batch_costs_its_padded_tokens_attending_to_their_past():
    # Two segments of (up to) 512 tokens after 1,024 stored ones: the rest of a 1,536-token prompt, twice.
    batch = Batch((0, 1), past_tokens=1024, max_tokens=512)
    assert batch.cost() == 2 * TOKEN_UNITS.seconds(1536, 1024)
    assert batch.cost() > Batch((0, 1), past_tokens=0, max_tokens=512).cost() > 2 * 512  # attention over the past
