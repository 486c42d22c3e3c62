"""A model's KV geometry, read from its Hugging Face config."""
from __future__ import annotations

from types import SimpleNamespace

from prefill.models import kv_layout
from store.format.header import Layout


def test_the_kv_layout_comes_from_the_model_config() -> None:
    gqa = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4, hidden_size=128)
    assert kv_layout(gqa, 16) == Layout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)
    # An explicit head_dim wins over hidden / heads; without KV heads, every head has its own KV.
    explicit = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=None, num_attention_heads=8,
                               hidden_size=512, head_dim=128)
    assert kv_layout(explicit, 256) == Layout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=256)
