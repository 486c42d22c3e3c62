"""Fleet records a reader checks before use (issue 31): shape, bounds, the file cap, per-namespace traffic."""
from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from store.config_sections import FleetMemoryConfig
from store.serving.fleet import Use, read_fleet
from store.serving.fleet_file import FORMAT, check_fleet_files
from store.tiers.stats import StoreStats
from tests.store.serving.fleet_factories import T0, local, names, recorder


def doc_of(**changes) -> bytes:
    """A valid record of node ``bad`` for acme (one key), with ``changes``."""
    doc = {"format": FORMAT, "namespace": "acme", "node": "bad", "written_at": T0, "traffic": 5, "window_s": 60.0,
           "keys": ["ab" * 32], "age_s": [1.5], "uses": [2], "traffic_age": [3]}
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("raw", [
    doc_of(extra="a prompt"),  # a field the format does not have
    doc_of(keys=["AB" * 32]), doc_of(keys=["ab" * 31]), doc_of(keys=[7]),
    doc_of(keys=["ab" * 32, "ab" * 32], age_s=[1, 2], uses=[1, 1], traffic_age=[0, 0]),  # a key twice
    doc_of(age_s=[1.5, 2.0]),  # columns of different lengths
    doc_of(uses=[0]), doc_of(uses=[6]), doc_of(uses=[2.0]), doc_of(traffic_age=[6]), doc_of(traffic_age=[True]),
    doc_of(traffic=-1), doc_of(traffic=10**13 + 1), doc_of(traffic=5.0), doc_of(traffic=True),
    doc_of(window_s=0), doc_of(window_s=float("inf")), doc_of(age_s=[60.5]), doc_of(age_s=["1"]),
    doc_of(written_at="1700000000"), doc_of(written_at=float("-inf")), doc_of(written_at=None),
    doc_of(written_at=time.time() + 3600),  # an hour ahead of the reader's clock
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
    b'{"traffic": ' + b"9" * 5000 + b"}",  # an integer past Python's digit limit
    b"\xff" + doc_of(), "é".encode("utf-16"),
])
def test_a_record_out_of_shape_or_bounds_is_skipped_whole_and_counted(tmp_path, raw):
    tier = local(tmp_path)
    tier.put_meta("fleet/acme/bad.json", doc_of())
    assert len(read_fleet([tier], ["acme"], since=0)) == 1  # the record before the change is valid
    tier.put_meta("fleet/acme/bad.json", raw)
    stats = StoreStats()
    assert read_fleet([tier], ["acme"], since=0, stats=stats) == []
    assert stats["corrupt"] == 1


def test_a_record_a_little_ahead_of_the_readers_clock_is_read(tmp_path):
    tier = local(tmp_path)
    tier.put_meta("fleet/acme/bad.json", doc_of(written_at=T0 + 60))  # another node's clock, a minute ahead
    assert [u.at for u in read_fleet([tier], ["acme"], since=0, now=T0)] == [T0 + 58.5]


def test_a_record_written_before_since_is_left_out_not_counted(tmp_path):
    tier = local(tmp_path)
    tier.put_meta("fleet/acme/bad.json", doc_of())
    stats = StoreStats()
    assert read_fleet([tier], ["acme"], since=T0 + 1, stats=stats) == [] and stats["corrupt"] == 0


def test_a_writer_keeps_its_file_under_the_cap_by_leaving_out_the_oldest_names(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier], max_file_bytes=16 << 10)
    served = names("acme", 400)  # ~80 bytes a name: ~32 KB of record
    for i, n in enumerate(served):
        rec.record([n], now=T0 + i * 0.01)
    rec.flush(now=T0 + 10)

    size = len(tier.get_meta("fleet/acme/node-a.json"))
    uses = read_fleet([tier], ["acme"], since=0, max_file_bytes=16 << 10)
    assert 15 << 10 < size <= 16 << 10 and 150 < len(uses) < 250
    assert [u.name for u in uses] == served[::-1][:len(uses)]  # the newest kept
    assert rec.stats["dropped"] == 400 - len(uses)


def test_each_namespace_counts_its_own_traffic_across_a_restart(tmp_path):
    tier = local(tmp_path)
    acme, beta = names("acme", 1), names("beta", 1)
    first = recorder([tier])
    first.record(acme, now=T0)
    for i in range(50):
        first.record(beta, now=T0 + 1 + i)
    first.close()

    second = recorder([tier])  # restarted: each namespace continues its own counter
    second.record(names("beta", 1) + names("public", 1), now=T0 + 100)
    second.record(acme, now=T0 + 101)
    second.flush(now=T0 + 102)

    counters = {ns: json.loads(tier.get_meta(f"fleet/{ns}/node-a.json"))["traffic"] for ns in ("acme", "beta",
                                                                                                 "public")}
    assert counters == {"acme": 2, "beta": 51, "public": 1}
    [use] = read_fleet([tier], ["acme"], since=0)
    assert (use.uses, use.traffic, use.traffic_age) == (2, 2, 0)


def test_a_name_twice_in_one_request_counts_once(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier])
    a = names("acme", 1)[0]
    rec.record([a, a], now=T0)
    rec.flush(now=T0 + 1)
    assert read_fleet([tier], ["acme"], since=0) == [Use(a, T0, 1, 1, "node-a", 0)]


def test_reading_a_record_near_the_cap_allocates_a_small_multiple_of_its_size(tmp_path):
    tier = local(tmp_path)
    n = 60_000  # ~5 MB of record, under the default cap
    rec = recorder([tier], max_names=n)
    for i in range(n // 50):
        rec.record(names("acme", 50), now=T0 + i * 0.01)
    rec.flush(now=T0 + 100)
    size = len(tier.get_meta("fleet/acme/node-a.json"))
    assert 4 << 20 < size < FleetMemoryConfig().max_file_bytes

    tracemalloc.start()
    try:
        uses = read_fleet([tier], ["acme"], since=0)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(uses) == n
    # the result (a Use per name) holds ~3.7 times the file; the parse adds at most one copy of the record
    assert held < 4.2 * size and peak < 5.5 * size, (held / size, peak / size)


def test_check_fleet_files_names_each_file_a_reader_would_skip(tmp_path):
    tier = local(tmp_path)
    rec = recorder([tier])
    rec.record(names("acme", 2) + names("public", 1), now=T0)
    rec.flush(now=T0 + 1)
    tier.put_meta("fleet/acme/bad.json", doc_of(uses=[True]))
    tier.put_meta("fleet/acme/huge.json", b" " * 70_000)
    tier.put_meta("fleet/acme/notes.txt", b"hello")

    found = dict(check_fleet_files(tier, max_file_bytes=64 << 10))

    assert sorted(found) == ["fleet/acme/bad.json", "fleet/acme/huge.json", "fleet/acme/notes.txt"]
    assert "uses 0" in found["fleet/acme/bad.json"] and "65536" in found["fleet/acme/huge.json"]
