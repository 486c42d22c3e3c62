"""The loader's metrics: each figure kept once (in its Prometheus collector), ``as_dict`` read back from them."""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from store.errors import SnapshotCorrupt, SnapshotError, SnapshotMismatch, StoreUnavailable, TenantAccessDenied
from store.miss import MissReason, reason_of
from store.serving.metrics import LoaderMetrics
from store.tiers.stats import StoreStats

DOCS = Path(__file__).resolve().parents[3] / "docs"


def metrics(registry: CollectorRegistry | None = None) -> tuple[LoaderMetrics, StoreStats]:
    stats = StoreStats()
    return LoaderMetrics(registry, tenant="acme", store=stats), stats


def test_every_reason_is_a_series_from_the_start_under_its_documented_label():
    m, _ = metrics()
    text = generate_latest(m.registry).decode()
    for reason in MissReason:
        assert f'kvwarm_loader_misses_total{{reason="{reason.value}",tenant="acme"}} 0.0' in text
        assert f'kvwarm_loader_hits_shortened_total{{reason="{reason.value}",tenant="acme"}} 0.0' in text
    assert m.as_dict()["misses_by_reason"] == {} and m.as_dict()["misses"] == 0


def test_the_reasons_are_the_ones_the_docs_list():
    table = (DOCS / "loader.md").read_text().split("| reason | when |", 1)[1].split("\n\n", 1)[0]
    documented = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {r.value for r in MissReason}


def test_misses_and_shortened_hits_are_counted_once_and_read_back():
    m, _ = metrics()
    m.lookup()
    m.lookup()
    m.miss(MissReason.CORRUPT)
    m.miss(MissReason.CORRUPT)
    m.miss(MissReason.EXPIRED)
    m.hit(48)
    m.shortened(MissReason.POOL_FULL)
    m.mapped(1000)
    m.prefetched("fetched", 3)
    m.pool(100, 200)

    d = m.as_dict()

    assert (d["lookups"], d["hits"], d["tokens_served"], d["bytes_mapped"]) == (2, 1, 48, 1000)
    assert d["misses_by_reason"] == {"corrupt": 2, "expired": 1} and d["misses"] == 3
    assert d["shortened_by_reason"] == {"pool_full": 1}
    assert (d["prefetch_fetched"], d["pool_bytes_in_use"], d["pool_budget_bytes"]) == (3, 100, 200)
    assert all(isinstance(d[k], int) for k in ("lookups", "tokens_served", "bytes_mapped", "prefetch_fetched"))
    text = generate_latest(m.registry).decode()
    assert 'kvwarm_loader_misses_total{reason="corrupt",tenant="acme"} 2.0' in text
    assert 'kvwarm_loader_tokens_served_total{tenant="acme"} 48.0' in text


def test_latency_percentiles_are_the_upper_edges_of_the_buckets_holding_them():
    m, _ = metrics()
    for _ in range(99):
        m.observe("lookup", 0.0003)
    m.observe("lookup", 2.0)
    m.observe("to_dynamic_cache", 30.0)  # beyond the last bucket: its edge, read as "at least"

    lat = m.as_dict()["latency"]

    assert lat["lookup"] == {"count": 100, "p50_s": 0.0005, "p99_s": 2.5}
    assert lat["to_dynamic_cache"] == {"count": 1, "p50_s": 5.0, "p99_s": 5.0}
    assert "copy_into_paged" not in lat  # only stages that were timed


def test_refusals_are_the_stores_count_exposed_as_the_loaders_counter():
    m, stats = metrics(CollectorRegistry(auto_describe=True))  # as prometheus_client.REGISTRY checks names
    stats.incr("refused")
    stats.incr("refused")
    assert m.as_dict()["refused_cross_tenant"] == 2
    assert 'kvwarm_loader_refused_cross_tenant_total{tenant="acme"} 2.0' in generate_latest(m.registry).decode()


def test_each_store_error_stands_for_one_reason():
    assert reason_of(SnapshotCorrupt("x")) is MissReason.CORRUPT
    assert reason_of(SnapshotMismatch("x")) is MissReason.MISMATCH
    assert reason_of(SnapshotError("no key")) is MissReason.UNDECRYPTABLE
    assert reason_of(TenantAccessDenied("x")) is MissReason.TENANT_REFUSED
    assert reason_of(StoreUnavailable("x")) is MissReason.STORE_UNAVAILABLE
    assert reason_of(OSError("disk")) is MissReason.ERROR
    assert str(MissReason.FETCH_SCHEDULED) == "fetch_scheduled"
