"""How large a payload is, from the geometry and precision alone: the KV bytes a token takes."""
from __future__ import annotations

import pytest

from store.config import KvCacheConfig
from store.format.header import Layout
from store.format.payload import canonical_layout, kv_bytes_per_token, payload_nbytes
from store.format.precision import Precision
from tests.store.factories import make_chain, make_root, make_snapshot

PRECISIONS = [
    Precision(),  # FP8 everywhere, one scale per layer and head
    Precision(keep_layers=(0,)),  # the config's default: layer 0 in bf16
    Precision(keep_layers=(0, 2), keep_dtype="fp16"),
    Precision(granularity="head_group", group_tokens=5),  # 16 tokens in groups of 5: 4 groups
    Precision(compression="bf16"),
    Precision(compression="fp32"),
]


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.scheme_id())
@pytest.mark.parametrize("heads, head_dim", [(2, 8), (3, 5)])  # 3 x 5 fp32 scales: not 8-byte multiples
def test_the_size_is_what_a_written_snapshot_lays_out(precision: Precision, heads: int, head_dim: int) -> None:
    root = make_root(precision=precision, block_size=16)
    snap = make_snapshot(root, make_chain(root, 1)[0], precision=precision, layers=3, heads=heads, head_dim=head_dim)
    layout = Layout(num_layers=3, num_kv_heads=heads, head_dim=head_dim, block_size=16)
    assert payload_nbytes(layout, precision) == canonical_layout(snap.header).nbytes == snap.payload.nbytes
    assert kv_bytes_per_token(layout, precision) == snap.payload.nbytes / 16


def test_an_8b_model_in_the_default_precision() -> None:
    # 32 layers, 8 KV heads of 128: 31 FP8 layers, layer 0 in bf16, and 31 x 2 x 8 fp32 scales a block.
    eight_b = Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=256)
    per_block = 31 * 2 * 8 * 128 * 256 + 2 * 8 * 128 * 256 * 2 + 31 * 2 * 8 * 4
    assert kv_bytes_per_token(eight_b, KvCacheConfig().precision()) == per_block / 256 == 67591.75
    assert kv_bytes_per_token(eight_b, Precision()) == 2 * 32 * 8 * 128 + 32 * 2 * 8 * 4 / 256  # no kept layer
