"""Issue 31, done-when 3, end to end: tenants cannot change the public KV another tenant loads, and a
request without a cache_salt never loads a salted tenant's KV.

One store: a public prefix stored by the public writer (the prefill job, holding the operator's
``tenants.public.writer_secret_env`` credential: the tier records it), and a prefix of acme's own.
One engine (write-back on; the connector's default tenant is ``public``, so a request without a salt
is public's) serves, in order:

1. beta (its own secret and cache_salt), a prompt that begins with the public prefix: it loads the
   public blocks and writes back what it computed, into beta's namespace (from block 0: a chain is
   found from its root), never into public;
2. acme, a prompt that begins with the same public prefix: it loads the public blocks, and returns
   vLLM's own greedy tokens;
3. no cache_salt, a prompt whose prefix only acme stored: nothing is loaded.

Afterwards every public file holds the bytes the public writer wrote, and nothing else is in public.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bench.lib.vllm_engine import run_engine
from store.config import load_config
from store.identity.tenant import PUBLIC
from tests.store.engines.vllm.harness import (
    connector,
    count,
    engine_spec,
    entry,
    environment,
    names_of,
    outcome,
    prefill_here,
    request,
    segment,
    write_config,
)
from tests.store.engines.vllm.prompts import PROMPTS, all_ids

#: secrets and cache_salts of at least 32 characters (the engine gets the tenants' secrets, not the writer's)
SECRETS = {"KVWARM_TEST_ACME_SECRET": "acme-secret-for-the-public-e2e-test-0001",
           "KVWARM_TEST_BETA_SECRET": "beta-secret-for-the-public-e2e-test-0002"}
WRITER = {"KVWARM_TEST_PUBLIC_WRITER": "the-operators-public-writer-credential-0003"}
SALT = {"acme": "cache-salt-of-acme-for-the-public-e2e-test", "beta": "cache-salt-of-beta-for-the-public-e2e-test"}
#: beta's prompt: the public prefix, then 300 tokens of its own (one more full kvwarm block to write back)
BETA_SUFFIX = (37700, 300)


def store_dir(cfg_path: Path) -> Path:
    return Path(load_config(cfg_path).store.url.removeprefix("file://"))


def public_files(cfg_path: Path) -> dict[str, str]:
    """sha256 of every object in the store's public namespace, by name."""
    base = store_dir(cfg_path) / "objects" / PUBLIC
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(base.rglob("*.kvw"))}


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("public-tenants")
    tenants = {"public": {"writer_secret_env": "KVWARM_TEST_PUBLIC_WRITER"},
               "acme": {"secret_env": "KVWARM_TEST_ACME_SECRET", "cache_salts": [SALT["acme"]]},
               "beta": {"secret_env": "KVWARM_TEST_BETA_SECRET", "cache_salts": [SALT["beta"]]}}
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="bf16", tenants=tenants)
    prefill_here(cfg, [entry(PROMPTS["public"].prefix, tenant=PUBLIC), entry(PROMPTS["tenant_a"].prefix)],
                 env={**SECRETS, **WRITER})
    before = public_files(cfg)
    ids = all_ids()
    beta_ids = PROMPTS["public"].prefix + segment(*BETA_SUFFIX)
    steps = [{"name": "beta", "requests": [request(beta_ids, salt=SALT["beta"])]},
             {"name": "acme", "requests": [request(ids["public"], salt=SALT["acme"])]},
             {"name": "nosalt", "requests": [request(ids["tenant_a"])]}]
    run = run_engine(engine_spec(steps, extra=connector(cfg, tenant=PUBLIC)), d / "engine", env=SECRETS)
    return cfg, before, beta_ids, run


def test_a_tenants_request_on_a_public_prefix_never_changes_what_another_tenant_loads(served, same_as_cold) -> None:
    cfg, before, beta_ids, run = served
    assert len(before) == 2  # the public prefix: two kvwarm blocks, written by the public writer
    record = json.loads((store_dir(cfg) / "meta" / "tenants" / "public.json").read_bytes())
    assert record.get("writer_id")  # the tier requires the writer's credential from now on

    (beta,) = run.calls("beta")
    assert outcome(beta).get("loaded_tokens") == 512  # beta read the public blocks
    worker = run.stats(None, "worker")  # after shutdown: the writer has drained
    assert count(worker, "written_back_blocks") >= 3
    with environment(SECRETS):
        written = names_of(cfg, "beta", beta_ids)
    assert len(written) == 3
    for name in written:  # beta's write-back went to beta's own namespace, from block 0
        assert (store_dir(cfg) / "objects" / name).is_file(), name
    assert public_files(cfg) == before  # and public holds exactly the writer's bytes

    (acme,) = run.calls("acme")
    assert outcome(acme).get("loaded_tokens") == 512
    same_as_cold("public", acme["tokens"])


def test_a_request_without_a_cache_salt_never_loads_a_salted_tenants_kv(served, same_as_cold) -> None:
    cfg, _, _, run = served
    (call,) = run.calls("nosalt")
    assert not outcome(call).get("loaded_tokens")  # acme's prefix is stored; a request without its salt gets none
    same_as_cold("tenant_a", call["tokens"])
