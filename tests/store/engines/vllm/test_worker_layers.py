"""The connector learns the model's layers when vLLM registers its KV caches: ``kv_cache.keep_layers``
that name a layer past them are refused there, before any KV is loaded or written back."""
from __future__ import annotations

import pytest
import torch

from store.config import parse_config
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.settings import ConnectorSettings
from store.engines.vllm.worker import WorkerRole
from store.errors import ConfigError
from tests.store.engines.vllm.worker_setup import D, EB, H, IDENT, KB, L, NB


@pytest.mark.parametrize("keep, total, ok", [((0, L - 1), None, True), ((0, L), None, False),
                                             ((0, 5), 6, True), ((0, 6), 6, False)])
def test_keep_layers_past_the_engine_s_model_are_refused_at_registration(tmp_path, monkeypatch, keep, total,
                                                                         ok) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    cfg = parse_config({"kv_cache": {"block_size": KB, "keep_layers": list(keep)},
                        "loader": {"pool_dir": str(tmp_path / "pool")}})
    w = WorkerRole(ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=cfg,
                                     model_dir=tmp_path), identities=(IDENT, None), engine_block=EB)
    caches = [torch.zeros((NB, H, EB, 2 * D), dtype=torch.bfloat16) for _ in range(L)]
    layout = EngineLayout("cpu_vec", NB, H, EB, D, torch.bfloat16)
    layers = None if total is None else list(range(total - L, total))  # the last stage of a pipeline
    try:
        if ok:
            w.register(caches, layout, total_kv_heads=H, layers=layers, total_layers=total)
        else:
            n = L if total is None else total
            with pytest.raises(ConfigError, match=rf"kv_cache.keep_layers = \[0, {keep[1]}\]: layer {keep[1]} is "
                                                  rf"outside the engine's model, which has {n} layers"):
                w.register(caches, layout, total_kv_heads=H, layers=layers, total_layers=total)
    finally:
        w.close()
