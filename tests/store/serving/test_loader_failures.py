"""Never fail the request: every store failure is a counted miss (or a shortened hit), and serving proceeds.

S3 is a real SeaweedFS started for the test (``own_s3``, not the session's: this one is killed).
No assertion here is on time: a call that must not hang runs under a generous hang guard
(tests/hang_guard.py), and what a call did is read from its counts and reasons.
"""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from store.config import parse_config
from store.identity.tenant import Tenant
from store.serving.loader import KVLoader
from store.tiers.s3 import S3Tier
from store.tiers.store import Store
from tests.hang_guard import HANG_S, returns
from tests.store.pool_workers import ACME, TINY, config, prompt, tiny_model, write_prefix

BS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.bfloat16)


def loader(tmp_path, cfg, sub="nvme", tenant=ACME, **kw) -> KVLoader:
    kw.setdefault("pool_bytes", 1 << 30)
    return KVLoader(kw.pop("url", f"file://{tmp_path}/{sub}"), tenant=tenant, model=TINY, config=cfg,
                    pool_dir=tmp_path / f"pool-{sub}", **kw)


def serve(model, hit, ids) -> list[int]:
    """A serving call: warm from the hit if there is one, cold otherwise."""
    cache = None
    if hit is not None:
        with hit:
            cache = hit.to_dynamic_cache("cpu", torch.bfloat16)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=4, do_sample=False)
    return out[0, len(ids):].tolist()


def cold(model, ids) -> list[int]:
    return serve(model, None, ids)


def put(tmp_path, cfg, model, ids, sub="nvme", **kw) -> Store:
    store = Store.open(f"file://{tmp_path}/{sub}", cfg)
    write_prefix(store, cfg, model, ids, **kw)
    return store


def test_a_corrupt_block_shortens_the_hit_and_is_quarantined(tmp_path, model):
    m, _ = model
    cfg = config(BS, "bf16")
    ids = prompt(3 * BS + 2, seed=30)
    store = put(tmp_path, cfg, m, ids[: 3 * BS])
    ld = loader(tmp_path, cfg)
    names = ld._own.names(ld.lookup(ids).blocks)  # maps all three (and verifies them) ...
    ld.close()
    path = store.local.path(names[1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # ... then a payload byte of the second rots on disk
    path.write_bytes(bytes(raw))
    fresh = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, pool_bytes=1 << 30,
                     pool_dir=tmp_path / "p2")  # a fresh node pool: the file is verified when admitted

    hit, reason = fresh.lookup_with_reason(ids)

    assert hit is not None and hit.tokens == BS and reason == "corrupt"  # served up to the bad block
    assert fresh.stats()["shortened_by_reason"] == {"corrupt": 1}
    assert not path.exists() and len(store.local.quarantined()) == 1
    assert serve(m, hit, ids) == cold(m, ids)
    fresh.close()


def test_corrupt_first_block_expired_and_mismatched_snapshots_are_misses(tmp_path, model):
    m, _ = model
    cfg = config(BS, "bf16")
    a, b, c = prompt(2 * BS + 1, seed=31), prompt(2 * BS + 1, seed=32), prompt(2 * BS + 1, seed=33)
    store = put(tmp_path, cfg, m, a[: 2 * BS])
    write_prefix(store, cfg, m, b[: 2 * BS], created_at=time.time() - 5 * 3600, ttl_s=4 * 3600)  # expired
    ld = loader(tmp_path, cfg)
    a_names = ld._own.names(ld.lookup(a).blocks)
    ld.close()
    # c's first block becomes a copy of a's: intact, but not what c asks for
    from store.identity.keys import block_chain

    c_name = ld._own.names(block_chain(ld.root, c))[0]
    store.local.path(c_name).parent.mkdir(parents=True, exist_ok=True)
    store.local.path(c_name).write_bytes(store.local.path(a_names[0]).read_bytes())
    path = store.local.path(a_names[0])
    path.write_bytes(path.read_bytes()[:-100])  # truncated

    fresh = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, pool_bytes=1 << 30,
                     pool_dir=tmp_path / "p2")
    for ids, why in ((a, "corrupt"), (b, "expired"), (c, "mismatch")):
        assert fresh.lookup_with_reason(ids) == (None, why)
        assert serve(m, None, ids) == cold(m, ids)
    assert fresh.stats()["misses_by_reason"] == {"corrupt": 1, "expired": 1, "mismatch": 1}
    assert len(store.local.quarantined()) == 2
    fresh.close()


def test_another_tenants_prefix_and_an_impostor_are_misses(tmp_path, model):
    m, _ = model
    cfg = config(BS, "bf16")
    ids = prompt(2 * BS + 1, seed=34)
    put(tmp_path, cfg, m, ids[: 2 * BS]).close()
    bolt = loader(tmp_path, cfg, tenant=Tenant.derive("bolt", "bolt-secret"))
    assert bolt.lookup(ids) is None  # its keys are salted differently: it cannot even name acme's blocks
    assert bolt.stats()["misses_by_reason"] == {"absent": 1}
    bolt.close()
    impostor = loader(tmp_path, cfg, tenant=Tenant.derive("acme", "a-guessed-secret"), sub="nvme")
    assert impostor.lookup(ids) is None
    stats = impostor.stats()
    assert stats["misses_by_reason"] == {"tenant_refused": 1} and stats["refused_cross_tenant"] == 1
    impostor.close()


def test_pool_full_is_a_miss_and_the_request_proceeds(tmp_path, model):
    m, _ = model
    cfg = config(BS, "bf16")
    ids = prompt(2 * BS + 1, seed=35)
    put(tmp_path, cfg, m, ids[: 2 * BS]).close()
    ld = loader(tmp_path, cfg, pool_bytes=1000)  # smaller than one snapshot
    assert ld.lookup(ids) is None
    assert ld.stats()["misses_by_reason"] == {"pool_full": 1}
    assert serve(m, None, ids) == cold(m, ids)
    ld.close()


def test_seaweedfs_killed_mid_run(tmp_path, model, own_s3, monkeypatch):
    m, _ = model
    # Roomy timeouts: the server is up (if slow on a loaded machine) until it is killed, and
    # a killed server refuses connections at once; no retries, so that refusal is final.
    s3 = {"endpoint_url": own_s3.endpoint, "access_key_env": "KVWARM_TEST_KEY", "secret_key_env": "KVWARM_TEST_SECRET",
          "op_timeout_s": 60, "connect_timeout_s": 10, "read_timeout_s": 30, "retries": 0}
    cfg = parse_config({"kv_cache": {"block_size": BS, "compression": "bf16"}, "store": {"s3": s3}})
    url = f"s3://kvwarm-loader/{uuid.uuid4().hex[:8]}"
    p1, p2, p3 = (prompt(2 * BS + 1, seed=s) for s in (40, 41, 42))
    writer = Store.open(f"file://{tmp_path}/writer,{url}", cfg, create_bucket=True)
    for ids in (p1, p2, p3):
        write_prefix(writer, cfg, m, ids[: 2 * BS])
    writer.close()
    s3_calls: list[str] = []  # every S3 request of this process, by what it was for
    real_call = S3Tier._call

    def counted(self, coro, what):  # type: ignore[no-untyped-def]
        s3_calls.append(what)
        return real_call(self, coro, what)

    monkeypatch.setattr(S3Tier, "_call", counted)

    # A sync wait long enough never to run out here (the fetch must not depend on this
    # machine's speed), and a backoff that cannot end during the test.
    sync = loader(tmp_path, cfg, sub="sync", url=f"file://{tmp_path}/sync,{url}", fetch_mode="sync",
                  sync_fetch_timeout_s=60.0)
    bg = loader(tmp_path, cfg, sub="bg", url=f"file://{tmp_path}/bg,{url}", s3_backoff_s=3600.0)

    hit = sync.lookup(p1)  # NVMe miss, S3 hit: fetched while the lookup waits
    assert hit is not None and hit.tier == "s3" and hit.tokens == 2 * BS
    assert serve(m, hit, p1) == cold(m, p1)
    assert bg.lookup(p2) is None  # the default: answer now, fetch for next time
    deadline = time.monotonic() + HANG_S  # a hang guard
    while not all(bg.local.exists(n) for n in bg._own.names(_blocks(bg, p2))):
        assert time.monotonic() < deadline, "background fetch did not land"
        time.sleep(0.1)
    hit = bg.lookup(p2)
    assert hit is not None and hit.tier == "nvme"
    hit.release()

    own_s3.stop()  # SIGKILL after a short grace: S3 is gone mid-run

    for ld in (sync, bg):
        assert returns(ld.lookup, p3) is None  # only in S3: a miss, not an exception, not a hang
        assert serve(m, None, p3) == cold(m, p3)
    hit = sync.lookup(p1)  # what is in NVMe keeps being served
    assert hit is not None and hit.tier in ("pool", "nvme")
    assert serve(m, hit, p1) == cold(m, p1)
    deadline = time.monotonic() + HANG_S  # a hang guard
    while not bg.stats()["s3_backoff"]:  # the background fetch of p3 fails, S3 is left alone a while
        assert time.monotonic() < deadline
        time.sleep(0.1)
    asked = len(s3_calls)
    assert returns(bg.lookup, p3) is None
    assert s3_calls[asked:] == [], "a lookup in the backoff asked S3"
    assert sync.stats()["misses_by_reason"] == {"store_unavailable": 1}  # the probe failed: no wait for S3
    assert bg.stats()["misses_by_reason"] == {"fetch_scheduled": 2, "store_unavailable": 1}
    sync.close()
    bg.close()


def _blocks(ld, ids):
    from store.identity.keys import block_chain

    return block_chain(ld.root, ids)


def test_an_empty_snapshot_file_is_a_corrupt_miss(tmp_path, model):
    m, _ = model
    cfg = config(BS, "fp8")
    ids = prompt(2 * BS + 1, seed=41)
    store = put(tmp_path, cfg, m, ids[: 2 * BS])
    ld = loader(tmp_path, cfg)
    from store.identity.keys import block_chain

    store.local.path(ld._own.names(block_chain(ld.root, ids))[0]).write_bytes(b"")  # nothing to map
    assert ld.lookup(ids) is None
    assert ld.stats()["misses_by_reason"] == {"corrupt": 1}
    assert serve(m, None, ids) == cold(m, ids)
    ld.close()
    store.close()


def test_the_fast_header_parse_reads_what_was_written_and_refuses_what_was_not():
    import json

    from store.errors import SnapshotCorrupt
    from store.format.encode import build_snapshot
    from store.format.header import SnapshotHeader
    from store.identity.keys import block_chain

    precision = config(BS, "fp8").kv_cache.precision()
    root = TINY.key_root(precision, BS, ACME.salt)
    kv = [(torch.randn((2, BS, 4)), torch.randn((2, BS, 4)))]
    header = build_snapshot(root=root, block=block_chain(root, list(range(BS)))[0], tenant="acme", kv=kv,
                            precision=precision, created_at=1.0, ttl_s=2.0).header
    assert SnapshotHeader.from_json(header.to_json()) == header
    d = json.loads(header.to_json())
    d["quant_error"]["k_rel_l2"] = [float("nan")]  # json writes NaN; a strict parser refuses it
    back = SnapshotHeader.from_json(json.dumps(d).encode())
    assert back.parts == header.parts and back.quant_error["k_rel_l2"][0] != back.quant_error["k_rel_l2"][0]
    d["parts"][0]["extra"] = 1
    with pytest.raises(SnapshotCorrupt, match="header fields are invalid"):
        SnapshotHeader.from_json(json.dumps(d).encode())
    del d["parts"][0]["extra"], d["parts"][0]["xxh3"]
    with pytest.raises(SnapshotCorrupt, match="header fields are invalid"):
        SnapshotHeader.from_json(json.dumps(d).encode())


@pytest.mark.parametrize("kw, named", [
    (dict(fetch_mode="sometimes"), "loader.fetch_mode = 'sometimes'"),
    (dict(fetch_workers=0), "loader.fetch_workers = 0"),
    (dict(sync_fetch_timeout_s=-1.0), "loader.sync_fetch_timeout_s = -1.0"),
    (dict(dequant="fast"), "loader.dequant = 'fast'"),
])
def test_bad_keywords_are_named_before_anything_is_opened(tmp_path, kw, named):
    from store.errors import ConfigError

    with pytest.raises(ConfigError, match="KVLoader keywords") as err:
        KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=config(16, "fp8"), **kw)
    assert named in str(err.value)
    assert not (tmp_path / "nvme").exists()  # nothing created: the keywords are checked first


def test_keywords_override_the_config_section(tmp_path):
    cfg = parse_config({"loader": {"fetch_mode": "sync", "verify_payload": False}})
    ld = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, pool_dir=tmp_path / "pool",
                  verify_payload=True)
    try:
        assert ld.fetch_mode == "sync" and ld.verify_payload is True  # from the config; from the keyword
    finally:
        ld.close()
