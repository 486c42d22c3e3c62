"""``prefill report``: the families of a run as a table or JSON, from real loader stats too."""
from __future__ import annotations

import json

import pytest

from prefill.cli import main
from prefill.monitoring import Prices, compute
from prefill.report_cli import format_table
from prefill.run_results import monitoring_for_run, read_run
from prefill.rundir import RunDir
from store.identity.tenant import Tenant
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.prefill.hand_run import PLAN, build_run
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16


def report(*args: str) -> int:
    return main(["report", *args])


def test_json_gives_the_hand_computed_families(tmp_path, capsys) -> None:
    url, dumps = build_run(tmp_path)
    assert report("--store", url, "--run", "r1", "--loader-stats", *map(str, dumps), "--gpu-price-per-hour", "3.6",
                  "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"run", "cache_efficiency", "service_quality", "security_audit", "economics", "notes"}
    assert out["cache_efficiency"]["memory_saving_ratio"] == pytest.approx(8.0)
    assert out["service_quality"]["lookup_p99_s"] == pytest.approx(0.004)
    assert out["security_audit"]["refused_cross_tenant"] == 2
    assert out["economics"]["cost_per_1k_requests_warm"] == pytest.approx(0.15)


def test_the_table_is_the_default_and_the_price_may_come_from_the_environment(tmp_path, capsys, monkeypatch) -> None:
    url, dumps = build_run(tmp_path)
    monkeypatch.setenv("KVWARM_GPU_PRICE_PER_HOUR", "3.6")
    assert report("--store", url, "--run", "r1", "--loader-stats", *map(str, dumps)) == 0
    text = capsys.readouterr().out
    assert text.startswith("kvwarm monitoring: run r1")
    assert "request_hit_rate" in text and "75.0%" in text and "cost_per_1k_requests_cold" in text and "0.4" in text


def test_the_price_may_come_from_the_config_file_and_a_flag_overrides_it(tmp_path, capsys, monkeypatch) -> None:
    url, dumps = build_run(tmp_path)
    monkeypatch.delenv("KVWARM_GPU_PRICE_PER_HOUR", raising=False)
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("monitoring:\n  gpu_price_per_hour: 3.6\n")
    args = ["--store", url, "--run", "r1", "--loader-stats", *map(str, dumps), "--json", "--config", str(cfg)]
    assert report(*args) == 0
    assert json.loads(capsys.readouterr().out)["economics"]["cost_per_1k_requests_warm"] == pytest.approx(0.15)
    assert report(*args, "--gpu-price-per-hour", "7.2") == 0
    assert json.loads(capsys.readouterr().out)["economics"]["cost_per_1k_requests_warm"] == pytest.approx(0.30)
    cfg.write_text("monitoring:\n  gpu_price_per_hour: -1\n")
    assert report(*args) == 2  # a bad value is refused with the key named
    assert "monitoring.gpu_price_per_hour" in capsys.readouterr().err


def test_dumps_kept_with_the_run_are_used_when_none_are_given(tmp_path, capsys) -> None:
    url, dumps = build_run(tmp_path)
    kept = tmp_path / "store" / "_flows" / "r1" / "loader_stats"
    kept.mkdir()
    for p in dumps:
        p.rename(kept / p.name)
    assert report("--store", url, "--run", "r1", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache_efficiency"]["source"] == "loader stats (2 dumps)" and out["cache_efficiency"]["lookups"] == 40


def test_a_missing_run_is_a_clear_error(tmp_path, capsys) -> None:
    assert report("--store", f"file://{tmp_path}", "--run", "nope") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path.resolve()}/_flows/nope" in err and "kvwarm pipeline writes it" in err


def test_a_missing_stats_file_is_a_clear_error(tmp_path, capsys) -> None:
    url, _ = build_run(tmp_path, dumps=False)
    assert report("--store", url, "--run", "r1", "--loader-stats", str(tmp_path / "node9.json")) == 2
    assert "node9.json does not exist" in capsys.readouterr().err


def test_real_loader_stats_feed_the_report(tmp_path, capsys) -> None:
    """Two real KVLoaders (a tenant and an impostor with a guessed secret) dump ``stats()``; the report adds them up."""
    cfg = config(BS, "fp8")
    url, _ = build_run(tmp_path, dumps=False, report=False)
    store = Store.open(url, cfg)
    ids = prompt(3 * BS + 5, seed=7)
    synthetic_prefix(store, cfg, ids[: 3 * BS], layers=2, heads=2, head_dim=16)
    store.close()
    dumps = []
    for name, tenant, prompts in (("acme", ACME, [ids, prompt(40, seed=99)]),
                                  ("impostor", Tenant.derive("acme", "a-guessed-secret"), [ids])):
        with KVLoader(url, tenant=tenant, model=TINY, config=cfg, pool_bytes=1 << 26,
                      pool_dir=tmp_path / f"pool-{name}") as loader:
            served = 0
            for p in prompts:
                hit = loader.lookup(p)
                if hit is not None:
                    with hit:
                        served += hit.usable_tokens
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps({**loader.stats(), "elapsed_s": 1.0,
                                        "prompt_tokens": sum(len(p) for p in prompts)}, default=str))
            dumps.append(path)
    assert served == 0  # the impostor got nothing
    assert report("--store", url, "--run", "r1", "--loader-stats", *map(str, dumps), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    cache, audit = out["cache_efficiency"], out["security_audit"]
    assert (cache["lookups"], cache["hits"], cache["tokens_served"]) == (3, 1, 3 * BS)
    assert cache["prompt_tokens"] == 2 * len(ids) + 40
    assert cache["bytes_mapped"] > 0
    bpt = PLAN["extra"]["kv_bytes_per_token"]  # the hand-built plan: 100 B/token
    assert cache["memory_saving_ratio"] == pytest.approx(3 * BS * bpt / cache["bytes_mapped"])
    assert audit["refused_cross_tenant"] == 1 and audit["by_reason"]["tenant_refused"] == 1
    assert out["service_quality"]["latency_samples"] == 3 and out["service_quality"]["lookups_per_s"] == 1.5
    assert out["service_quality"]["lookup_p99_s"] > 0


def test_the_table_shows_every_family_in_readable_units_and_n_a_for_what_is_missing(tmp_path) -> None:
    url, dumps = build_run(tmp_path)
    text = format_table(monitoring_for_run(url, "r1", dumps, Prices(gpu_per_hour=3.6)))
    for family in ("cache_efficiency", "service_quality", "security_audit", "economics"):
        assert family in text
    assert "75.0%" in text and "8.00x" in text and "4.000 ms" in text and "1,050,000 B" in text
    bare = tmp_path / "_flows" / "bare"
    bare.mkdir(parents=True)
    text = format_table(compute("bare", read_run(RunDir(bare)), []))
    assert "lookups" in text and "n/a" in text and "notes:" in text


def test_the_store_may_come_before_the_command_and_is_required(tmp_path, capsys) -> None:
    url, dumps = build_run(tmp_path)
    assert main(["--store", url, "report", "--run", "r1", "--loader-stats", *map(str, dumps), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "r1"
    assert report("--run", "r1") == 2
    assert "prefill: error: prefill report needs --store URL" in capsys.readouterr().err
