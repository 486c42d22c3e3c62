"""``prefill store audit`` on KV a real vLLM engine wrote back: all of it agrees, in bf16 and FP8 storage,
and a written-back block replaced by wrong KV (under its right key, through the real encoder) is flagged.

vLLM's CPU kernels compute the KV the connector writes back; the audit recomputes it with
transformers (``prefill warm``'s code path). The two differ by rounding (about 1 % relative L2),
which the agreement rule's tolerance covers (docs/guides/operating-a-store.md); wrong KV differs
by O(1). The bf16 store is the session's (``bf16_engine`` wrote its blocks back; the audit only
reports there, so the other engine tests find the store as they left it); the FP8 store is this
module's own.
"""
from __future__ import annotations

import json
import time

import pytest

from bench.lib.vllm_engine import run_engine
from prefill.cli import main
from store.config import load_config
from store.format.encode import build_snapshot
from store.identity.keys import block_chain
from store.tiers.store import Store
from tests.prefill.audit_store import wrong_kv
from tests.store.engines.vllm.harness import (
    TENANT,
    TENANTS,
    connector,
    count,
    engine_spec,
    request,
    segment,
    tiny_dir,
    tiny_model,
    write_config,
)

#: two prompts of 3 and 2 kvwarm blocks (and some), from corpus stretches no other engine test uses
PROMPTS = [segment(15000, 3 * 256 + 30), segment(16000, 2 * 256 + 70)]


def audit_json(capsys, config, *args: str) -> tuple[int, dict]:
    code = main(["store", "audit", "--config", str(config), "--model", str(tiny_dir()), "--all", "--json", *args])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fp8_written_back(engine, tmp_path_factory):
    """An FP8 store (layer 0 kept in bf16, the default) holding only what an engine wrote back."""
    d = tmp_path_factory.mktemp("fp8-audit")
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="fp8",
                       tenants=TENANTS)
    steps = [{"name": "write", "requests": [request(p, max_tokens=1) for p in PROMPTS], "together": True}]
    run = run_engine(engine_spec(steps, extra=connector(cfg)), d / "engine")
    assert count(run.stats(None, "worker"), "written_back_blocks") == 5
    return cfg


def test_the_audit_finds_every_block_a_bf16_engine_wrote_back_right(bf16_store, bf16_engine, capsys) -> None:
    code, report = audit_json(capsys, bf16_store, "--dtype", "bf16", "--no-quarantine")
    wb, pf = report["by_source"]["write-back"], report["by_source"]["prefill"]
    assert code == 0 and report["differed"] == 0, report["differences"]
    assert wb["checked"] >= 2 and wb["agreed"] == wb["checked"]  # written_back's two blocks, at least
    assert pf["checked"] > 0 and pf["agreed"] == pf["checked"]  # and what prefill warm stored
    assert wb["max_tolerance_used"] < 0.5  # vLLM and transformers apart by rounding only, well inside the tolerance


def test_the_audit_finds_an_fp8_engines_write_back_right_and_flags_a_wrong_block(fp8_written_back, capsys) -> None:
    code, report = audit_json(capsys, fp8_written_back)
    wb = report["by_source"]["write-back"]
    assert code == 0 and (wb["checked"], wb["agreed"]) == (5, 5) and wb["max_tolerance_used"] < 0.5
    cfg = load_config(fp8_written_back)
    tenant, precision = cfg.tenant(TENANT), cfg.kv_cache.precision()
    loaded = tiny_model()
    root = loaded.key_root(precision, 256, tenant.salt)
    block = block_chain(root, PROMPTS[0])[2]
    store = Store.open(cfg.store.url, cfg)
    assert store.delete(tenant, block.key) == 1  # the engine's block 2, replaced by KV after a wrong prefix
    assert store.put(tenant, build_snapshot(root=root, block=block, tenant=TENANT,
                                            kv=wrong_kv(loaded, PROMPTS[0], 2, 256, "garbage_prefix"),
                                            precision=precision, created_at=time.time(), ttl_s=3600.0,
                                            source="write-back"))
    store.close()
    code, report = audit_json(capsys, fp8_written_back)
    assert code == 1 and (report["checked"], report["differed"], report["quarantined"]) == (5, 1, 1)
    assert block.key in report["differences"][0][0]
