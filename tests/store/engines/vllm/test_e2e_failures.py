"""Done-when 3 and 4, end to end: kvwarm never fails a request, and tenants stay apart, in one vLLM engine.

One engine (tenants ``acme``, the default, and ``beta``, by its vLLM ``cache_salt``) on a store of
a local tier and a SeaweedFS S3 tier holds one prefix per way of going wrong:

- ``corrupt``: a byte of a stored block's payload flipped;
- ``expired``: stored with a one-second TTL;
- ``other_model``: snapshots of another model's KV put where this model's keys point;
- ``other_tenant``: stored for ``beta``, asked for by ``acme``;
- ``s3_hit``: only in S3 (fetched within ``sync_fetch_timeout_s``), and ``s3_down``: only in
  S3, asked for after SeaweedFS was killed while the engine runs.

Each request completes with the cold tokens, and its miss is counted under its reason
(kvwarm's counters and the request's ``kv_transfer_params``). Isolation: ``tenant_a``
(stored for acme) is loaded for a request without a salt (acme's) and refused, counted, for beta's
salt; ``public`` serves both; an unmapped salt gets nothing; a tenant named in ``kv_transfer_params``
without its salt gets nothing (``tenants.trust_named`` is off). What the client receives for
a refusal is what it receives for a prompt nobody stores (``unstored``): the server's counters
alone say why.
"""
from __future__ import annotations

import uuid

import pytest

from bench.lib.vllm_engine import start_engine
from store.config import load_config
from store.identity.keys import block_chain
from store.tiers.base import object_name
from store.tiers.store import Store
from tests.seaweedfs import SeaweedFS
from tests.store.engines.vllm.harness import (
    S3_ENV,
    SALTS,
    TENANT,
    TENANTS,
    connector,
    count,
    engine_spec,
    entry,
    names_of,
    outcome,
    prefill_here,
    request,
    s3_store,
    write_config,
)
from tests.store.engines.vllm.prompts import PROMPTS, all_ids
from tests.store.pool_workers import TINY as ANOTHER_MODEL
from tests.store.pool_workers import synthetic_prefix

SYNC_FETCH_TIMEOUT_S = 5.0
#: what each request of the "local" step is, and what the client must be told:
#: (prompt, salt, kvwarm_tenant, loads?, reason); refusals are told "absent", like a prompt nobody stores
LOCAL = [
    ("corrupt", None, None, False, "corrupt"),
    ("expired", None, None, False, "expired"),
    ("other_model", None, None, False, "mismatch"),
    ("other_tenant", None, None, False, "absent"),  # beta's, asked for by acme: refused
    ("tenant_a", None, None, True, None),  # acme's: the default tenant's
    ("tenant_a", SALTS["beta"], None, False, "absent"),  # acme's, asked for by beta: refused
    ("public", None, None, True, None),
    ("public", SALTS["beta"], None, True, None),
    ("public", "salt-nobody", None, False, "absent"),  # a salt no tenant lists
    ("s3_hit", None, None, True, None),
    ("unstored", None, None, False, "absent"),  # acme's miss, nobody holding it
    ("unstored", SALTS["beta"], None, False, "absent"),  # beta's
    ("other_tenant", None, "beta", False, "absent"),  # beta's name without beta's salt
    ("other_tenant", None, "nobody", False, "absent"),  # a name the config does not know
]


def local_call(calls, name: str, salt: str | None = None, tenant: str | None = None) -> dict:
    (i,) = [i for i, (n, s, t, _, _) in enumerate(LOCAL) if (n, s, t) == (name, salt, tenant)]
    return calls[i]


def flip_a_payload_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def put_another_models_kv(config, nvme, ids) -> None:
    """Snapshots of another model's KV (same geometry, other fingerprint), renamed to this model's keys."""
    cfg = load_config(config)
    acme = cfg.tenant(TENANT)
    scratch = nvme.parent / "other-model"
    store = Store.open(f"file://{scratch}", cfg)
    synthetic_prefix(store, cfg, ids, layers=4, heads=2, head_dim=32, tenant=acme, identity=ANOTHER_MODEL)
    store.close()
    root = ANOTHER_MODEL.key_root(cfg.kv_cache.precision(), 256, acme.salt)
    for theirs, ours in zip((object_name(TENANT, b.key) for b in block_chain(root, ids)),
                            names_of(config, TENANT, ids)):
        dest = nvme / "objects" / ours
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((scratch / "objects" / theirs).read_bytes())


@pytest.fixture(scope="module")
def failures(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("failures")
    weed = SeaweedFS().start()
    try:
        import s3fs

        s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": weed.endpoint}).mkdir("kvwarm-e2e")
        s3 = f"s3://kvwarm-e2e/t-{uuid.uuid4().hex[:12]}"
        nvme = d / "nvme"
        sections = dict(
            store=s3_store(weed.endpoint),
            loader={"fetch_mode": "sync", "sync_fetch_timeout_s": SYNC_FETCH_TIMEOUT_S, "verify_payload": True},
            tenants=TENANTS,
            # a one-second TTL is allowed for the "expired" prefix; every other one gets the default
            kv_cache={"ttl_min_hours": 1 / 3600},
        )
        cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{nvme},{s3}", compression="bf16", **sections)
        p = {n: PROMPTS[n].prefix for n in PROMPTS}
        prefill_here(cfg, [entry(p["corrupt"]), entry(p["expired"], ttl_s=1), entry(p["other_tenant"], tenant="beta"),
                           entry(p["tenant_a"]), entry(p["public"], tenant="public")],
                     store=f"file://{nvme}", env=S3_ENV)
        # S3 only: written through another node's local tier
        prefill_here(cfg, [entry(p["s3_hit"]), entry(p["s3_down"])], store=f"file://{d}/other-node,{s3}", env=S3_ENV)
        flip_a_payload_byte(nvme / "objects" / names_of(cfg, TENANT, p["corrupt"])[1])
        put_another_models_kv(cfg, nvme, p["other_model"])
        ids = all_ids()
        steps = [{"name": "local", "requests": [request(ids[n], salt=s, tenant=t) for n, s, t, _, _ in LOCAL],
                  "together": True},
                 {"name": "kill_s3", "barrier": True},
                 {"name": "s3_down", "requests": [request(ids["s3_down"])]}]
        proc = start_engine(engine_spec(steps, extra=connector(cfg, write_back=False)), d / "engine", env=S3_ENV)
        try:
            proc.at_barrier("kill_s3")
            weed.stop()  # mid-run: the engine is up, its S3 tier goes away
            proc.go("kill_s3")
            run = proc.wait()
        finally:
            proc.stop()
        return run
    finally:
        weed.stop()


@pytest.mark.s3
def test_every_broken_snapshot_is_a_counted_miss_and_the_request_gets_the_cold_tokens(failures, cold,
                                                                                      same_as_cold):
    calls = failures.calls("local")
    for (name, salt, tenant, loads, reason), call in zip(LOCAL, calls):
        what = f"{name} (salt {salt}, kvwarm_tenant {tenant})"
        got = outcome(call)
        if got.get("loaded_tokens"):
            same_as_cold(name, call["tokens"])  # prefill warm's KV: up to a near tie
        else:
            assert call["tokens"] == cold[name], f"{what}: not the cold tokens"  # vLLM computed it all
        if loads:
            assert got.get("loaded_tokens") == 512 and got.get("reason") is None, (what, got)
        else:
            # a corrupt second block may leave the first one loaded; nothing past it is used
            assert got.get("loaded_tokens", 0) < 512 and got.get("reason") == reason, (what, got)
    stats = failures.stats("local")
    failed = {k: v for k, v in stats.items() if k.startswith(("misses:", "load_failures:")) and v}
    for reason in ("corrupt", "expired", "mismatch", "tenant_refused", "tenant_unknown", "tenant_unverified"):
        assert any(k.endswith(":" + reason) for k in failed), (reason, failed)
    # what loaded: the four good prefixes, and the corrupt one's first block at most
    loaded = [outcome(c).get("loaded_tokens", 0) for c in calls]
    assert count(stats, "tokens_loaded") == sum(loaded) == 512 * sum(1 for *_, ok, _ in LOCAL if ok) + loaded[0]
    misses = sum(v for k, v in stats.items() if k.startswith("misses:"))
    assert count(stats, "lookups") == len(LOCAL) == count(stats, "hits") + misses


@pytest.mark.s3
def test_with_s3_killed_mid_run_the_request_completes_cold_with_a_counted_miss(failures, cold):
    call = failures.calls("s3_down")[0]
    assert call["tokens"] == cold["s3_down"]
    got = outcome(call)
    assert got.get("loaded_tokens") == 0
    assert got.get("reason") in ("store_unavailable", "fetch_timeout"), got
    assert "Traceback" not in failures.log_text()


@pytest.mark.s3
def test_another_tenants_prefix_loads_nothing_and_the_refusal_is_counted(failures):
    stats = failures.stats("local")
    # acme asking for beta's prefix, and beta's salt asking for acme's prefix
    assert count(stats, "refused_cross_tenant") == 2
    assert count(stats, "misses", "tenant_refused") == 2


def seen(call: dict) -> dict:
    """Everything the client received but the generated tokens and the batch's wall time."""
    return {k: v for k, v in call.items() if k not in ("tokens", "index", "seconds", "rep")}


@pytest.mark.s3
def test_a_client_cannot_tell_a_refusal_from_a_prompt_nobody_stores(failures, cold):
    calls = failures.calls("local")
    absent = seen(local_call(calls, "unstored"))
    assert absent["kv_transfer_params"] == {"kvwarm": {"loaded_tokens": 0, "reason": "absent"}}, absent
    # another tenant holds it, or nobody does: the same, for acme and for beta
    assert seen(local_call(calls, "other_tenant")) == absent
    assert seen(local_call(calls, "tenant_a", SALTS["beta"])) == seen(local_call(calls, "unstored", SALTS["beta"]))
    assert seen(local_call(calls, "public", "salt-nobody")) == absent
    # a configured tenant's name and an unknown one, without a salt: the same call, tokens included (cold)
    named, unknown = local_call(calls, "other_tenant", tenant="beta"), local_call(calls, "other_tenant", tenant="nobody")
    assert seen(named) == seen(unknown) == absent and named["tokens"] == unknown["tokens"] == cold["other_tenant"]
    # the server knows why
    stats = failures.stats("local")
    assert count(stats, "misses", "tenant_unverified") == 2 and count(stats, "misses", "tenant_unknown") == 1

