"""The four monitoring families: hand-built run directories and stats dumps give hand-computed figures."""
from __future__ import annotations

import json

import pytest

from prefill.monitoring import MonitoringError, Prices, compute, kv_bytes_per_token
from prefill.run_results import monitoring_for_run, read_loader_stats, read_run
from prefill.rundir import RunDir
from tests.prefill.hand_run import DUMP_A, DUMP_B, PLAN, build_run


def test_two_dumps_and_a_run_give_the_hand_computed_families(tmp_path) -> None:
    url, dumps = build_run(tmp_path)
    m = monitoring_for_run(url, "r1", dumps, Prices(gpu_per_hour=3.6))  # 3.6/h = 0.001 per GPU-second
    c = m.cache
    assert (c.lookups, c.hits, c.tokens_served, c.prompt_tokens) == (40, 30, 12000, 16000)
    assert c.request_hit_rate == pytest.approx(0.75) and c.token_hit_rate == pytest.approx(0.75)
    assert c.kv_bytes_per_token == pytest.approx(100.0)
    assert c.kv_bytes_served == pytest.approx(1_200_000) and c.bytes_mapped == 150_000
    assert c.memory_saved_bytes == pytest.approx(1_050_000) and c.memory_saving_ratio == pytest.approx(8.0)
    assert c.source == "loader stats (2 dumps)"
    s = m.service
    assert s.lookup_p50_s == pytest.approx(0.002) and s.lookup_p99_s == pytest.approx(0.004)  # the larger of the two
    assert s.latency_p99_s == pytest.approx({"lookup": 0.004, "to_dynamic_cache": 0.02})
    assert s.latency_samples == 40 and s.elapsed_s == pytest.approx(20.0)
    assert s.lookups_per_s == pytest.approx(2.0) and s.prefill_tokens_per_s == pytest.approx(1000.0)
    a = m.security
    assert a.refused_cross_tenant == 2 and a.integrity_refusals == 2  # corrupt (cut short) + mismatch
    assert a.by_reason == {"tenant_refused": 2, "corrupt": 1, "mismatch": 1, "unknown_version": 0}
    e = m.economics
    assert e.gpu_seconds_saved == pytest.approx(12.0) and e.gpu_seconds_spent == pytest.approx(2.0)
    assert e.net_gpu_seconds_saved == pytest.approx(10.0)
    assert e.cost_saved == pytest.approx(0.012) and e.cost_spent == pytest.approx(0.002)
    assert e.cost_per_1k_requests_cold == pytest.approx(0.4)  # 16 GPU-s x 0.001 / 40 requests x 1000
    assert e.cost_per_1k_requests_warm == pytest.approx(0.15)  # (4 + 2) GPU-s x 0.001 / 40 x 1000
    assert e.saving_per_1k_requests == pytest.approx(0.25)  # 10 GPU-s x 0.001 / 40 x 1000
    assert m.notes == ()


def test_a_prefill_rate_override_values_the_saved_tokens_at_that_rate(tmp_path) -> None:
    url, dumps = build_run(tmp_path)
    m = monitoring_for_run(url, "r1", dumps, Prices(gpu_per_hour=3.6, prefill_tokens_per_s=4000.0))
    assert m.economics.gpu_seconds_saved == pytest.approx(3.0)
    assert m.economics.net_gpu_seconds_saved == pytest.approx(1.0)
    assert m.service.prefill_tokens_per_s == pytest.approx(1000.0)  # the job's measured rate is still reported


def test_without_dumps_the_replay_in_report_json_gives_the_cache_figures(tmp_path) -> None:
    url, _ = build_run(tmp_path, dumps=False)
    m = monitoring_for_run(url, "r1")
    assert (m.cache.lookups, m.cache.hits, m.cache.tokens_served, m.cache.prompt_tokens) == (20, 15, 4000, 8000)
    assert m.cache.token_hit_rate == pytest.approx(0.5) and m.cache.source == "report.json replay"
    assert m.cache.memory_saving_ratio is None and m.cache.kv_bytes_served == pytest.approx(400_000)
    assert m.economics.gpu_seconds_saved == pytest.approx(4.0) and m.economics.cost_saved is None
    assert m.security.refused_cross_tenant is None and m.service.lookup_p99_s is None
    text = " ".join(m.notes)
    assert "--loader-stats" in text and "--gpu-price-per-hour" in text


def test_a_run_with_only_a_plan_says_what_is_missing(tmp_path) -> None:
    out = tmp_path / "_flows" / "bare"
    out.mkdir(parents=True)
    m = compute("bare", read_run(RunDir(out)), [])
    assert m.cache.source == "none" and m.economics.gpu_seconds_saved is None
    text = " ".join(m.notes)
    assert "prefill.json" in text and "--loader-stats" in text and "plan.json" in text
    assert m.as_dict()["cache_efficiency"]["lookups"] is None


def test_dumps_without_prompt_tokens_or_elapsed_leave_those_figures_out_and_say_why(tmp_path) -> None:
    url, _ = build_run(tmp_path, dumps=False)
    bare = {k: v for k, v in DUMP_A.items() if k not in ("elapsed_s", "prompt_tokens")}
    m = compute("r1", read_run(RunDir.of(url, "r1")), [bare, DUMP_B], Prices(gpu_per_hour=1.0))
    assert m.cache.lookups == 40 and m.cache.prompt_tokens is None and m.cache.token_hit_rate is None
    assert m.service.lookups_per_s is None and m.economics.cost_per_1k_requests_cold is None
    assert m.economics.saving_per_1k_requests == pytest.approx(10.0 / 3600 / 40 * 1000)
    text = " ".join(m.notes)
    assert "prompt_tokens" in text and "elapsed_s" in text


def test_a_missing_run_names_the_path_and_what_writes_it(tmp_path) -> None:
    with pytest.raises(MonitoringError, match=r"no run directory .*_flows/nope.*kvwarm pipeline writes it"):
        monitoring_for_run(f"file://{tmp_path}", "nope")


def test_a_bad_run_name_is_refused_as_a_monitoring_error(tmp_path) -> None:
    with pytest.raises(MonitoringError, match="without '/'"):
        monitoring_for_run(f"file://{tmp_path}", "../up")


def test_bad_stats_dumps_are_refused_with_the_file_named(tmp_path) -> None:
    with pytest.raises(MonitoringError, match="does not exist"):
        read_loader_stats([tmp_path / "absent.json"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MonitoringError, match=f"{bad}.*not JSON"):
        read_loader_stats([bad])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"lookups": 3}))
    with pytest.raises(MonitoringError, match=r"not a KVLoader.stats\(\) dump.*hits"):
        read_loader_stats([other])
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(MonitoringError, match="holds a list"):
        read_loader_stats([listed])


def test_a_corrupt_run_file_is_named(tmp_path) -> None:
    url, _ = build_run(tmp_path, dumps=False)
    RunDir.of(url, "r1").prefill.write_text("oops")
    with pytest.raises(MonitoringError, match="prefill.json"):
        monitoring_for_run(url, "r1")


def test_prices_come_from_arguments_then_the_environment_and_are_checked() -> None:
    assert Prices.from_env(None, environ={"KVWARM_GPU_PRICE_PER_HOUR": "2.5"}).gpu_per_hour == 2.5
    assert Prices.from_env(4.0, environ={"KVWARM_GPU_PRICE_PER_HOUR": "2.5"}).gpu_per_hour == 4.0
    assert Prices.from_env(None, environ={}).gpu_per_hour is None
    with pytest.raises(MonitoringError, match="not a number"):
        Prices.from_env(None, environ={"KVWARM_GPU_PRICE_PER_HOUR": "cheap"})
    with pytest.raises(MonitoringError, match="non-negative"):
        Prices(gpu_per_hour=-1.0)
    with pytest.raises(MonitoringError, match="positive"):
        Prices(prefill_tokens_per_s=0.0)


def test_kv_bytes_per_token_comes_from_the_plan() -> None:
    assert kv_bytes_per_token(PLAN) == pytest.approx(100.0)
    # Not derived back from what was planned: a plan that does not record it has none.
    assert kv_bytes_per_token({"extra": {"planned_store_bytes": 4800.0}, "entries": PLAN["entries"]}) is None
    assert kv_bytes_per_token(None) is None
