"""Snapshots whose identity and checksums are sound but whose geometry lies (issue 31, point 4).

Each file here is written as a writer would write it: a header with valid checksums (the header's
own, recomputed when the file is serialised, and every part's, over bytes left as they were), the
right key, tokens and model. Only the geometry disagrees: the header's layout with its parts, a
part's shape with its byte count, or one block of a chain with the others. Before the fix each
passed ``KVLoader.lookup`` and ``prefill store verify``, then raised in ``dequantized`` or
``copy_into_paged``; now the reader refuses it (a counted, quarantined miss) or cuts the chain.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from prefill.cli import main
from store.format.encode import EncodedSnapshot, build_snapshot
from store.identity.keys import Block, block_chain
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.pool_workers import ACME, TINY, config, prompt

BS = 16
CFG = config(BS, "fp8")  # layer 0 kept in bf16 (the default keep_layers), the others FP8 with per-head scales
PRECISION = CFG.kv_cache.precision()
ROOT = TINY.key_root(PRECISION, BS, ACME.salt)


def _snapshot(block: Block, *, layers: int = 2, heads: int = 2, dim: int = 16, seed: int = 0) -> EncodedSnapshot:
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(heads, BS, dim, generator=g), torch.randn(heads, BS, dim, generator=g)) for _ in range(layers)]
    return build_snapshot(root=ROOT, block=block, tenant=ACME.name, kv=kv, precision=PRECISION,
                          created_at=time.time(), ttl_s=3600)


def _retouched(snap: EncodedSnapshot, **changes: object) -> EncodedSnapshot:
    """``snap`` with header fields replaced and its payload untouched: the part checksums still
    hold, and the header's checksum is computed afresh when the file is written."""
    return EncodedSnapshot(dataclasses.replace(snap.header, **changes), snap.payload)


def _part(snap: EncodedSnapshot, name: str, **changes: object) -> tuple:
    return tuple(p._replace(**changes) if p.name == name else p for p in snap.header.parts)


def _store(tmp_path: Path, snaps: list[EncodedSnapshot]) -> str:
    url = f"file://{tmp_path / 'nvme'}"
    store = Store.open(url, CFG)
    for s in snaps:
        assert store.put(ACME, s)
    store.close()
    return url


def _loader(tmp_path: Path, url: str) -> KVLoader:
    return KVLoader(url, tenant=ACME, model=TINY, config=CFG, pool_bytes=1 << 30, pool_dir=tmp_path / "pool")


def _verify(tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text(f"kv_cache:\n  block_size: {BS}\n")
    code = main(["store", "--config", str(cfg), "--store", url, "verify", "--no-quarantine"])
    return code, capsys.readouterr().out


def _caches(layers: int, heads: int = 2, dim: int = 16) -> list[torch.Tensor]:
    return [torch.zeros(2, 4, BS, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]


@pytest.mark.parametrize("field, value", [("num_kv_heads", 4), ("num_layers", 3), ("head_dim", 8),
                                          ("keep_layers", (0, 1))])
def test_attack_header_layout_disagreeing_with_its_parts_is_a_counted_quarantined_miss(
        tmp_path, capsys, field, value) -> None:
    ids = prompt(2 * BS + 1, seed=1)
    chain = block_chain(ROOT, ids[: 2 * BS])
    good = _snapshot(chain[0])
    if field == "keep_layers":  # the precision says both layers are bf16; the parts (and quant_scheme) say not
        bad = _retouched(good, precision=dataclasses.replace(PRECISION, keep_layers=value))
    else:
        bad = _retouched(good, layout=dataclasses.replace(good.header.layout, **{field: value}))
    url = _store(tmp_path, [bad, _snapshot(chain[1], seed=1)])

    code, out = _verify(tmp_path, url, capsys)
    assert code == 1 and out.count("CORRUPT") == 1 and chain[0].key in out
    loader = _loader(tmp_path, url)
    hit, reason = loader.lookup_with_reason(ids)  # no exception: a miss, counted and quarantined
    assert hit is None and reason == "corrupt"
    assert loader.stats()["misses_by_reason"] == {"corrupt": 1}
    assert loader.store.stats["quarantined"] == 1 and len(loader.local.quarantined()) == 1
    loader.close()


@pytest.mark.parametrize("name, changes", [
    ("k.0", dict(shape=(2, 16, 32))),  # twice the elements its 1024 bytes hold
    ("k.1", dict(shape=(2, 8, 16))),  # half of them: a view of the wrong tokens
    ("k.1", dict(shape=(2.0, 16.0, 16.0))),  # JSON floats: equal to the right shape, no tensor dimension
    ("v_scale.1", dict(shape=(1,))),  # one scale where the 8 bytes hold two
])
def test_attack_part_shape_disagreeing_with_its_byte_count_is_a_counted_quarantined_miss(
        tmp_path, capsys, name, changes) -> None:
    ids = prompt(2 * BS + 1, seed=2)
    chain = block_chain(ROOT, ids[: 2 * BS])
    second = _snapshot(chain[1], seed=1)
    bad = _retouched(second, parts=_part(second, name, **changes))
    url = _store(tmp_path, [_snapshot(chain[0]), bad])

    code, out = _verify(tmp_path, url, capsys)
    assert code == 1 and out.count("CORRUPT") == 1 and chain[1].key in out
    loader = _loader(tmp_path, url)
    hit, reason = loader.lookup_with_reason(ids)
    assert hit is not None and hit.tokens == BS and reason == "corrupt"  # served up to the bad block
    assert loader.stats()["shortened_by_reason"] == {"corrupt": 1}
    kv = hit.dequantized(torch.bfloat16)
    assert [tuple(t.shape) for t in kv] == [(2, BS, 16)] * 4
    assert hit.copy_into_paged(_caches(2), [0, 1]) == BS
    hit.release()
    loader.close()


@pytest.mark.parametrize("first, second", [
    (dict(layers=3), dict(layers=2)),  # the engine's 3-layer caches; the second block has no layer 2
    (dict(heads=2), dict(heads=4)),  # the second block's 4 heads would be cut to the first's 2 (wrong KV)
    (dict(dim=16), dict(dim=8)),
])
def test_attack_chain_mixing_layouts_is_cut_at_the_first_block_that_differs(tmp_path, capsys, first, second) -> None:
    ids = prompt(3 * BS + 1, seed=3)
    chain = block_chain(ROOT, ids[: 3 * BS])
    url = _store(tmp_path, [_snapshot(chain[0], **first), _snapshot(chain[1], seed=1, **second),
                            _snapshot(chain[2], seed=2, **first)])

    code, out = _verify(tmp_path, url, capsys)  # each file is sound; the chain is not
    assert code == 1 and chain[1].key in out and "parent" in out
    loader = _loader(tmp_path, url)
    hit, reason = loader.lookup_with_reason(ids)
    assert hit is not None and len(hit.blocks) == 1 and reason == "mismatch"  # the consistent prefix
    assert loader.stats()["shortened_by_reason"] == {"mismatch": 1}
    layers, heads, dim = first.get("layers", 2), first.get("heads", 2), first.get("dim", 16)
    assert [tuple(t.shape) for t in hit.dequantized(torch.bfloat16)] == [(heads, BS, dim)] * (2 * layers)
    assert hit.copy_into_paged(_caches(layers, heads, dim), [0, 1]) == BS
    hit.release()
    assert loader.local.quarantined() == []  # every file is sound: nothing is taken away
    loader.close()
