"""The prefill job against the real tiny model and a real local store."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from prefill.runner import DeadlinePassed, Prefiller, PrefillError, PrefillOptions, PrefixRequest
from store.format.precision import relative_error
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from tests.prefill.factories import BLOCK, config_for

ACME = Tenant.derive("acme", "s3cret")


@contextlib.contextmanager
def counting_tokens(loaded):
    """Counts the tokens the model's embedding layer sees (every forward token, padding included)."""
    seen = [0]
    h = loaded.model.model.embed_tokens.register_forward_pre_hook(lambda m, a: seen.__setitem__(0, seen[0] + a[0].numel()))
    try:
        yield seen
    finally:
        h.remove()


def opts(config, **kw):
    return PrefillOptions(precision=config.kv_cache.precision(), block_size=config.kv_cache.block_size, **kw)


def req(ids, order=0, tenant=ACME):
    return PrefixRequest(tenant=tenant, token_ids=tuple(ids), ttl_s=3600.0, order=order)


SYSTEM = [(7 * i + 3) % 4000 for i in range(3 * BLOCK)]


def prompts(n=10, suffix_blocks=2):
    return [SYSTEM + [(97 * p + 13 * i) % 4000 + 10 for i in range(suffix_blocks * BLOCK)] for p in range(n)]


def test_shared_system_prompt_runs_through_the_model_once(tiny, store, config):
    with counting_tokens(tiny) as seen:
        report = Prefiller(tiny, store, opts(config)).run([req(p, i) for i, p in enumerate(prompts())])
    assert seen[0] == 3 * BLOCK + 10 * 2 * BLOCK  # the system prompt's 3 blocks once, each suffix once
    assert report.blocks_written == 3 + 20 and report.tokens_computed == seen[0]
    root = tiny.key_root(config.kv_cache.precision(), BLOCK, ACME.salt)
    for p in prompts():
        assert store.probe(ACME, block_chain(root, p), root).count == 5


def test_rerun_skips_what_exists_and_extends_from_stored_kv(tiny, store, config):
    first = prompts(3)
    Prefiller(tiny, store, opts(config)).run([req(p) for p in first])
    with counting_tokens(tiny) as seen:
        again = Prefiller(tiny, store, opts(config)).run([req(p) for p in first])
    assert seen[0] == 0 and again.blocks_written == 0 and again.blocks_stored_before == again.blocks_total
    longer = first[0] + [11] * BLOCK
    with counting_tokens(tiny) as seen:
        more = Prefiller(tiny, store, opts(config)).run([req(longer)])
    assert seen[0] == BLOCK and more.blocks_written == 1  # only the new block, continued from stored KV


def test_continuing_from_stored_kv_matches_a_full_prefill(tiny, tmp_path):
    from store.tiers.store import Store

    cfg = config_for("bf16")
    ids = prompts(1, suffix_blocks=2)[0]
    stores = [Store.open(f"file://{tmp_path / n}", cfg) for n in ("split", "whole")]
    Prefiller(tiny, stores[0], opts(cfg)).run([req(ids[: 3 * BLOCK])])
    Prefiller(tiny, stores[0], opts(cfg)).run([req(ids)])      # continues after 3 stored blocks
    Prefiller(tiny, stores[1], opts(cfg)).run([req(ids)])      # one pass
    root = tiny.key_root(cfg.kv_cache.precision(), BLOCK, ACME.salt)
    last = block_chain(root, ids)[-1]
    a, b = (s.get(ACME, last, root).layer(0, torch.float32) for s in stores)
    # the continued pass saw bf16-rounded past KV: equal up to bf16 rounding of its inputs
    assert relative_error(b[0], a[0]) < 2e-2 and relative_error(b[1], a[1]) < 2e-2


def test_recorded_error_equals_a_recomputation(tiny, store, config):
    ids = prompts(1, suffix_blocks=1)[0]
    Prefiller(tiny, store, opts(config)).run([req(ids)])
    root = tiny.key_root(config.kv_cache.precision(), BLOCK, ACME.salt)
    with torch.no_grad():
        cache = tiny.model(torch.tensor([ids]), use_cache=True).cache
    for b in block_chain(root, ids):
        snap = store.get(ACME, b, root)
        assert snap.header.origin == "prefill"  # the header says where the KV was computed
        sl = slice(b.index * BLOCK, (b.index + 1) * BLOCK)
        for i, layer in enumerate(cache.layers):
            stored = snap.layer(i, torch.float32)  # FP8 dequantised, or the kept layer's bf16 (layer 0 by default)
            for name, ref, back in (("k", layer.keys[0, :, sl], stored[0]), ("v", layer.values[0, :, sl], stored[1])):
                assert snap.header.quant_error[f"{name}_rel_l2"][i] == pytest.approx(relative_error(ref, back), rel=1e-4, abs=1e-7)
                bound = 0.01 if i in config.kv_cache.keep_layers else 0.1  # bf16 rounds to 2^-9, e4m3 to 2^-4
                assert 0 < snap.header.quant_error[f"{name}_rel_l2"][i] < bound


def test_a_past_deadline_writes_nothing(tiny, store, config):
    with pytest.raises(DeadlinePassed, match="already past"):
        Prefiller(tiny, store, opts(config, deadline=1.0)).run([req(p) for p in prompts(2)])
    assert store.list(ACME) == []


def test_a_deadline_too_near_for_one_batch_writes_nothing(tiny, store, config):
    now = 1_000_000.0
    p = Prefiller(tiny, store, opts(config, deadline=now + 1e-5), clock=lambda: now)
    with pytest.raises(DeadlinePassed, match="too near"):
        p.run([req(x) for x in prompts(4)])
    assert store.list(ACME) == []


def test_the_deadline_stops_between_batches_keeping_whole_blocks(tiny, store, config):
    t = [time.time()]

    class Clock:
        def __call__(self):
            return t[0]

    from prefill.progress import Progress

    class Jump(Progress):
        def advance(self, tokens):
            super().advance(tokens)
            t[0] += 50.0  # each finished segment "takes" 50 s of the window

    p = Prefiller(tiny, store, opts(config, deadline=t[0] + 120.0, max_batch_size=1), clock=Clock(), progress=Jump())
    independent = [[(31 * k + i) % 4000 for i in range(2 * BLOCK)] for k in range(6)]
    report = p.run([req(x, i) for i, x in enumerate(independent)])
    assert report.stopped == "deadline" and 0 < report.blocks_written < 12
    assert report.blocks_left == 12 - report.blocks_written
    # what was written are the highest-priority prefixes, complete and readable
    root = tiny.key_root(config.kv_cache.precision(), BLOCK, ACME.salt)
    done = [store.probe(ACME, block_chain(root, x), root).count for x in independent]
    assert done == sorted(done, reverse=True)
    for x, n in zip(independent, done):
        for b in block_chain(root, x)[:n]:
            assert store.get(ACME, b, root) is not None


def test_out_of_memory_halves_the_batch_and_retries(tiny, store, config, monkeypatch):
    real = tiny.model.forward

    def forward(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if ids is not None and ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: batch larger than 2)")
        return real(*a, **kw)

    monkeypatch.setattr(tiny.model, "forward", forward)
    independent = [[(17 * k + i) % 4000 for i in range(BLOCK)] for k in range(8)]
    report = Prefiller(tiny, store, opts(config)).run([req(x) for x in independent])
    assert report.oom_splits >= 2 and report.blocks_written == 8


def test_a_prefix_shorter_than_a_block_is_refused(tiny, store, config):
    with pytest.raises(PrefillError, match="shorter than one block"):
        Prefiller(tiny, store, opts(config)).run([req([1, 2, 3])])


def test_writer_threads_store_the_same_snapshots_as_one_writer(tiny, config, tmp_path):
    from store.tiers.store import Store

    stores = {n: Store.open(f"file://{tmp_path}/w{n}", config) for n in (1, 4)}
    reports = {n: Prefiller(tiny, s, opts(config, write_threads=n)).run([req(p, i) for i, p in enumerate(prompts(4))])
               for n, s in stores.items()}
    assert reports[1].blocks_written == reports[4].blocks_written == 3 + 8
    assert reports[1].quant_error_max == reports[4].quant_error_max
    root = tiny.key_root(config.kv_cache.precision(), BLOCK, ACME.salt)
    for p in prompts(4):
        chain = block_chain(root, p)
        got = [stores[n].get(ACME, chain[-1], root) for n in (1, 4)]
        assert got[0].header.parts == got[1].header.parts  # the same bytes, checksum by checksum
        for g in got:
            g.close()
    for s in stores.values():
        s.close()
