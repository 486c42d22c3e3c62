"""Report helpers: per-bucket replay figures, the hit-rate plot, the monitoring families and their artifacts."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from flows import report as reports
from prefill.rundir import RunDir
from tests.prefill.hand_run import DUMP_A, DUMP_B, build_run

T0 = pd.Timestamp("2026-03-04 03:00")


def outcomes() -> pd.DataFrame:
    """Six requests over three 30-minute buckets (the middle one empty after the first two)."""
    rows = [  # minutes after T0, prompt tokens, prewarmed, cold, planned prefixes it begins with
        (5, 100, 80, 0, "p1"),
        (20, 100, 80, 80, "p1"),
        (25, 50, 0, 0, ""),
        (95, 200, 160, 160, "p1,p2"),  # nested planned prefixes: one request, both used
        (100, 100, 0, 48, ""),
        (110, 100, 64, 64, "p2"),
    ]
    return pd.DataFrame([{"timestamp": T0 + pd.Timedelta(minutes=m), "tenant": "acme", "prompt_tokens": n,
                          "cached_tokens": w, "cold_cached_tokens": c, "planned": p} for m, n, w, c, p in rows])


def test_replay_buckets_are_hand_computed() -> None:
    b = reports.replay_buckets(outcomes(), "30min", ["p1", "p2", "p3"], start=T0, end=T0 + pd.Timedelta(hours=2))
    assert list(b["ds"]) == [T0 + pd.Timedelta(minutes=30 * i) for i in range(4)]
    assert list(b["requests"]) == [3, 0, 0, 3]
    assert b["token_hit_rate"].iloc[0] == pytest.approx(160 / 250)
    assert b["cold_token_hit_rate"].iloc[0] == pytest.approx(80 / 250)
    assert b["token_hit_rate"].iloc[3] == pytest.approx(224 / 400)
    assert b["cold_token_hit_rate"].iloc[3] == pytest.approx(272 / 400)  # the cold cache may beat the plan
    assert b["token_hit_rate"].iloc[1:3].isna().all() and b["recall"].iloc[1:3].isna().all()  # empty: no rate
    assert list(b["covered"]) == [2, 0, 0, 2]
    assert b["recall"].iloc[0] == pytest.approx(2 / 3) and b["recall"].iloc[3] == pytest.approx(2 / 3)
    assert list(b["used_so_far"]) == [1, 1, 1, 2]
    assert list(b["precision_so_far"]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 2 / 3])


def test_replay_buckets_cut_to_the_window_and_check_their_input() -> None:
    b = reports.replay_buckets(outcomes(), "1h", [], start=T0 + pd.Timedelta(minutes=10))
    assert list(b["ds"]) == [T0, T0 + pd.Timedelta(hours=1)]  # buckets start on the bucket grid
    assert list(b["requests"]) == [2, 3]  # the request at 03:05 is before the window
    assert (b["precision_so_far"] == 1.0).all()  # an empty plan wastes nothing
    with pytest.raises(ValueError, match="lack column"):
        reports.replay_buckets(outcomes().drop(columns=["planned"]), "1h", [])
    with pytest.raises(ValueError, match="positive duration"):
        reports.replay_buckets(outcomes(), "0s", [])
    with pytest.raises(ValueError, match="give start and end"):
        reports.replay_buckets(outcomes().iloc[:0], "1h", [])


def test_the_hit_rate_plot_is_a_png(tmp_path) -> None:
    b = reports.replay_buckets(outcomes(), "30min", ["p1", "p2"], start=T0, end=T0 + pd.Timedelta(hours=2))
    path = reports.plot_replay(b, tmp_path / "hitrate.png", bucket="30min")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_monitoring_summary_reads_the_run_and_its_kept_dumps(tmp_path) -> None:
    url, dumps = build_run(tmp_path)
    out = RunDir.of(url, "r1")
    # no dumps kept yet: the in-memory summary's replay stands in for report.json's
    fresh = {"run": "r1", "replay": {"requests": 4, "requests_hit": 1, "cached_tokens": 10, "prompt_tokens": 40}}
    m = reports.monitoring_summary(out, fresh)
    assert m["cache_efficiency"]["source"] == "report.json replay"
    assert m["cache_efficiency"]["lookups"] == 4 and m["cache_efficiency"]["token_hit_rate"] == pytest.approx(0.25)
    out.loader_stats.mkdir()
    for p in dumps:
        p.rename(out.loader_stats / p.name)
    m = reports.monitoring_summary(out, fresh, gpu_price_per_hour=3.6)
    assert m["cache_efficiency"]["lookups"] == DUMP_A["lookups"] + DUMP_B["lookups"]
    assert m["economics"]["saving_per_1k_requests"] == pytest.approx(0.25)
    json.dumps(m)  # report.json takes it as is


def test_markdown_renders_the_families_as_one_table(tmp_path) -> None:
    url, dumps = build_run(tmp_path)
    out = RunDir.of(url, "r1")
    out.loader_stats.mkdir()
    for p in dumps:
        p.rename(out.loader_stats / p.name)
    text = reports.markdown({"run": "r1", "plan": {"entries": 2},
                             "monitoring": reports.monitoring_summary(out, gpu_price_per_hour=3.6)})
    assert "| family | figure | value |" in text
    assert "| cache_efficiency | memory_saving_ratio | 8.00x |" in text
    assert "| security_audit | refused_cross_tenant | 2 |" in text
    assert "| economics | cost_per_1k_requests_warm | 0.15 |" in text
    assert "| entries | 2 |" in text  # other sections as before
    # Small nested fields are shown inline; long ones are counted.
    text = reports.markdown({"run": "r1", "mine": {"similarity": {"threshold": 0.935, "source": "adapted"},
                                                   "partitions": [f"part-{i}: " + "x" * 40 for i in range(9)]}})
    assert '| similarity | `{"threshold": 0.935, "source": "adapted"}` |' in text
    assert "| partitions | 9 item(s) |" in text


def test_the_families_are_published_as_a_table_artifact(prefect_harness, tmp_path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    url, dumps = build_run(tmp_path)
    out = RunDir.of(url, "r1")
    out.loader_stats.mkdir()
    for p in dumps:
        p.rename(out.loader_stats / p.name)

    @flow
    def publish() -> None:
        reports.publish_monitoring(reports.monitoring_summary(out, gpu_price_per_hour=3.6), "Run_1")

    publish()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["kvwarm-run-1-monitoring"])))
    assert len(found) == 1 and found[0].type == "table"
    table = json.loads(found[0].data) if isinstance(found[0].data, str) else found[0].data
    rows = {(r["family"], r["figure"]): r["value"] for r in table}
    assert rows[("cache_efficiency", "request_hit_rate")] == "75.0%"
    assert rows[("service_quality", "lookup_p99_s")] == "4.000 ms"
    assert rows[("economics", "cost_per_1k_requests_cold")] == "0.4"
