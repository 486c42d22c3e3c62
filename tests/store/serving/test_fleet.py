"""Fleet memory: a node's record of the blocks it served, written to the tiers and merged back by readers."""
from __future__ import annotations

import json
import threading
import tracemalloc

import pytest

from store.errors import ConfigError, StoreUnavailable
from store.serving.fleet import NODE_ID_ENV, FleetRecorder, Use, read_fleet, resolve_node_id
from store.serving.fleet_file import FORMAT
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.stats import StoreStats
from tests.store.serving.fleet_factories import T0, local, names, recorder

class DownTier(LocalTier):
    """A tier whose metadata area cannot be reached (an S3 outage)."""

    kind = "down"

    def get_meta(self, name):
        raise StoreUnavailable("down")

    def put_meta(self, name, data):
        raise StoreUnavailable("down")

    def list_meta(self, prefix):
        raise StoreUnavailable("down")


def test_a_record_reads_back_newest_first_with_its_counts(tmp_path):
    tier = local(tmp_path)
    a, b, c = names("acme", 3)
    rec = recorder([tier])
    rec.record([a, b], now=T0 + 1)
    rec.record([a], now=T0 + 2)
    rec.record([c, a], now=T0 + 3)

    assert rec.flush(now=T0 + 10) == 1
    uses = read_fleet([tier], ["acme"], since=T0)

    assert uses == [Use(a, T0 + 3, 3, 3, "node-a", 0), Use(c, T0 + 3, 1, 3, "node-a", 0),
                    Use(b, T0 + 1, 1, 1, "node-a", 2)]
    assert tier.list_meta("fleet/") == ["fleet/acme/node-a.json"]
    doc = json.loads(tier.get_meta("fleet/acme/node-a.json"))
    assert doc["format"] == FORMAT and doc["traffic"] == 3 and doc["node"] == "node-a"
    # salted block names only: nothing that could carry a prompt
    assert set(doc) == {"format", "namespace", "node", "written_at", "traffic", "window_s", "keys", "age_s", "uses",
                        "traffic_age"}


def test_records_are_batched_until_flush_s_has_passed(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], flush_s=30)
    for i in range(50):
        rec.record(names("acme", 4), now=T0 + i * 0.1)
        assert rec.maybe_flush(now=T0 + i * 0.1) == 0
    assert tier.list_meta("fleet/") == [] and not rec.due(now=T0 + 29.9)

    assert rec.due(now=T0 + 30) and rec.maybe_flush(now=T0 + 30) == 1
    assert len(read_fleet([tier], ["acme"], since=0)) == 200
    # nothing new: the next interval writes nothing
    assert rec.maybe_flush(now=T0 + 61) == 0
    rec.record(names("acme", 1), now=T0 + 62)
    assert rec.maybe_flush(now=T0 + 70) == 0 and rec.maybe_flush(now=T0 + 91) == 1
    assert rec.stats["requests"] == 51 and rec.stats["files_written"] == 2


def test_at_most_max_names_per_namespace_the_least_recently_used_go(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], max_names=3)
    a, b, c, d, e = names("acme", 5)
    for i, n in enumerate([a, b, c, a, d, e]):
        rec.record([n], now=T0 + i)
    rec.record(names("bolt", 2), now=T0 + 9)  # a bound per namespace: bolt's names do not push acme's out

    rec.flush(now=T0 + 10)

    assert [u.name for u in read_fleet([tier], ["acme"], since=0)] == [e, d, a]
    assert len(read_fleet([tier], ["bolt"], since=0)) == 2
    assert rec.stats["dropped"] == 2


def test_a_requests_blocks_read_back_in_chain_order_and_the_tail_goes_first(tmp_path):
    tier = local(tmp_path)
    chain = names("acme", 5)
    rec = recorder([tier], max_names=4)
    rec.record(chain, now=T0)
    rec.flush(now=T0 + 1)
    assert [u.name for u in read_fleet([tier], ["acme"], since=0)] == chain[:4]


def test_memory_stays_bounded_however_many_names_pass(tmp_path):
    rec = recorder([local(tmp_path)], max_names=1000)
    first = [names("acme", 32) for _ in range(32)]  # 1,024 names: past the bound
    then = [names("acme", 32) for _ in range(400)]  # 12,800 new names more
    tracemalloc.start()
    try:
        for b in first:
            rec.record(b, now=T0)
        full, _ = tracemalloc.get_traced_memory()
        for b in then:
            rec.record(b, now=T0)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - full < 64 << 10, f"the recorder grew by {after - full} bytes past its bound"
    assert rec.stats["dropped"] == 32 * 32 + 400 * 32 - 1000


def test_names_unused_for_window_s_are_dropped_at_flush(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], window_s=3600)
    old, kept = names("acme", 2)
    rec.record([old], now=T0)
    rec.record([kept], now=T0 + 3000)
    rec.flush(now=T0 + 3100)
    assert len(read_fleet([tier], ["acme"], since=0)) == 2

    rec.flush(now=T0 + 3601)  # nothing recorded, but a name left the window: the file is rewritten

    assert [u.name for u in read_fleet([tier], ["acme"], since=0)] == [kept]
    assert rec.stats["expired"] == 1
    rec.flush(now=T0 + 7000)
    assert read_fleet([tier], ["acme"], since=0) == [] and tier.list_meta("fleet/") == ["fleet/acme/node-a.json"]


def test_since_leaves_older_uses_out(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier])
    a, b = names("acme", 2)
    rec.record([a], now=T0)
    rec.record([b], now=T0 + 100)
    rec.flush(now=T0 + 101)
    assert [u.name for u in read_fleet([tier], ["acme"], since=T0 + 50)] == [b]
    assert read_fleet([tier], ["acme"], since=T0 + 200) == []


def test_a_reader_sees_only_the_namespaces_it_asks_for(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier])
    acme, bolt, public = names("acme", 3), names("bolt", 3), names("public", 1)
    rec.record(acme + public, now=T0)
    rec.record(bolt, now=T0 + 1)
    rec.flush(now=T0 + 2)
    assert sorted(tier.list_meta("fleet/")) == ["fleet/acme/node-a.json", "fleet/bolt/node-a.json",
                                                "fleet/public/node-a.json"]

    seen = {u.name for u in read_fleet([tier], ["acme", "public"], since=0)}

    assert seen == set(acme + public)
    assert {u.name for u in read_fleet([tier], ["bolt"], since=0)} == set(bolt)
    # a prefix of another namespace's name is not that namespace
    assert read_fleet([tier], ["acm"], since=0) == []
    with pytest.raises(ValueError, match="tenant name"):
        read_fleet([tier], ["acme/../bolt"], since=0)


def test_a_file_under_one_namespace_never_yields_another_namespaces_names(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], node="thief")
    rec.record(names("bolt", 2), now=T0)
    rec.flush(now=T0 + 1)
    # the same bytes planted under acme: they say namespace bolt, so acme's reader skips them
    tier.put_meta("fleet/acme/thief.json", tier.get_meta("fleet/bolt/thief.json"))
    stats = StoreStats()

    assert read_fleet([tier], ["acme"], since=0, stats=stats) == []
    assert stats["corrupt"] == 1


def test_traffic_counter_and_age_are_per_node_and_merged(tmp_path):
    tier = local(tmp_path)
    shared, only_a, only_b = names("acme", 3)
    a, b = recorder([tier], node="node-a"), recorder([tier], node="node-b")
    a.record([shared, only_a], now=T0 + 1)  # node-a request 1
    for i in range(9):
        a.record(names("acme", 1), now=T0 + 2 + i)  # requests 2..10
    for i in range(3):
        b.record(names("acme", 1), now=T0 + 1 + i)  # node-b requests 1..3
    b.record([shared], now=T0 + 5)  # node-b request 4
    b.record([only_b], now=T0 + 6)  # node-b request 5
    a.flush(now=T0 + 20)
    b.flush(now=T0 + 20)

    uses = {u.name: u for u in read_fleet([tier], ["acme"], since=0)}

    # latest use at node-b (its request 4), used on both nodes, 1 request ago at node-b (9 at node-a)
    assert uses[shared] == Use(shared, T0 + 5, 2, 4, "node-b", 1)
    assert uses[only_a] == Use(only_a, T0 + 1, 1, 1, "node-a", 9)
    assert uses[only_b] == Use(only_b, T0 + 6, 1, 5, "node-b", 0)
    assert len(uses) == 15
    others = read_fleet([tier], ["acme"], since=0, exclude_node="node-a")
    assert {u.node for u in others} == {"node-b"} and len(others) == 5
    assert {u.name: u for u in others}[shared].traffic_age == 1


def test_readers_never_see_a_half_written_file(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], max_names=20_000)
    stop, seen, stats = threading.Event(), [], StoreStats()

    def read() -> None:
        while not stop.is_set():
            seen.append(len(read_fleet([tier], ["acme"], since=0, stats=stats)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(20):  # each file is ~1.6 MB: far more than one write() of the writer
            rec.record(names("acme", 1000), now=T0 + i)
            rec.flush(now=T0 + i)
    finally:
        stop.set()
        reader.join()
    assert stats["corrupt"] == 0 and seen
    assert all(n % 1000 == 0 for n in seen), sorted(set(seen))


@pytest.mark.parametrize("garbage", [b"{not json", b'{"format": "kvwarm-fleet/1"}', b"", b"\xff\xfe",
                                     b'{"format": "kvwarm-fleet/1", "namespace": "acme", "node": "bad", '
                                     b'"written_at": 1, "traffic": 1, "window_s": 1, "keys": ["zz"], "age_s": [0], '
                                     b'"uses": [1], "traffic_age": [0]}'])
def test_a_corrupt_file_is_skipped_and_counted(tmp_path, garbage):
    tier = local(tmp_path)
    rec = recorder([tier])
    good = names("acme", 2)
    rec.record(good, now=T0)
    rec.flush(now=T0 + 1)
    tier.put_meta("fleet/acme/bad.json", garbage)
    stats = StoreStats()

    assert {u.name for u in read_fleet([tier], ["acme"], since=0, stats=stats)} == set(good)
    assert stats["corrupt"] == 1


def test_a_corrupt_copy_in_the_fast_tier_is_read_from_the_next(tmp_path):
    fast, slow = local(tmp_path, "fast"), local(tmp_path, "slow")
    rec = recorder([fast, slow])
    good = names("acme", 2)
    rec.record(good, now=T0)
    rec.flush(now=T0 + 1)
    fast.put_meta("fleet/acme/node-a.json", b'{"truncat')
    stats = StoreStats()

    assert {u.name for u in read_fleet([fast, slow], ["acme"], since=0, stats=stats)} == set(good)
    assert stats["corrupt"] == 1


def test_a_failing_tier_is_counted_never_raised(tmp_path):
    down, up = DownTier(tmp_path / "down", cap_bytes=1 << 20), local(tmp_path)
    rec = recorder([up, down])
    rec.record(names("acme", 3), now=T0)

    assert rec.flush(now=T0 + 1) == 1
    assert rec.stats["tier_failures"] >= 1
    stats = StoreStats()
    assert len(read_fleet([down, up], ["acme"], since=0, stats=stats)) == 3
    assert stats["tier_failures"] == 1  # the listing of the down tier

    only_down = recorder([down], node="node-b")
    only_down.record(names("acme", 1), now=T0)
    assert only_down.flush(now=T0 + 1) == 0  # no tier took it: it is written again next time
    assert only_down.flush(now=T0 + 2) == 0 and only_down.stats["tier_failures"] >= 2
    only_down.close()


def test_a_restarted_node_continues_its_own_record(tmp_path):
    tier = local(tmp_path)
    before, after = names("acme", 2), names("acme", 1)
    first = recorder([tier])
    first.record(before[:1], now=T0)
    first.record(before[1:], now=T0 + 1)
    first.record(before[:1], now=T0 + 2)
    first.close()  # counter at 3

    second = recorder([tier])  # same node id: the engine restarted
    second.record(after, now=T0 + 100)
    second.record(before[1:], now=T0 + 101)
    second.flush(now=T0 + 102)

    uses = {u.name: u for u in read_fleet([tier], ["acme"], since=0)}
    assert set(uses) == set(before + after)
    # the counter goes on from the previous record's 3: requests 4 and 5
    assert uses[after[0]] == Use(after[0], T0 + 100, 1, 4, "node-a", 1)
    assert uses[before[1]] == Use(before[1], T0 + 101, 2, 5, "node-a", 0)
    assert uses[before[0]] == Use(before[0], T0 + 2, 2, 3, "node-a", 2)
    assert second.stats["resumed"] == 1


def test_a_bad_name_is_refused():
    rec = FleetRecorder([], "node-a")
    for bad in ["acme/ab/cd.kvw", "prompt text", "../x/" + "a" * 64 + ".kvw", object_name("acme", "a" * 64)[:-1]]:
        with pytest.raises(ValueError):
            rec.record([bad])
    with pytest.raises(ValueError, match="node id"):
        FleetRecorder([], "a/b")
    with pytest.raises(ValueError, match="max_names"):
        FleetRecorder([], "a", max_names=0)


def test_the_node_id_comes_from_the_keyword_the_env_the_config_then_the_host(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "host-7")
    assert resolve_node_id("given", "configured", {NODE_ID_ENV: "env"}) == "given"
    assert resolve_node_id(None, "configured", {NODE_ID_ENV: "env"}) == "env"
    assert resolve_node_id(None, "configured", {}) == "configured"
    assert resolve_node_id(None, None, {}) == "host-7"
    with pytest.raises(ConfigError, match=NODE_ID_ENV):
        resolve_node_id(None, None, {NODE_ID_ENV: "two words"})
