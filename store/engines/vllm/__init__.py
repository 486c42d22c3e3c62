"""kvwarm inside vLLM: the KV connector ``KvwarmConnector`` (vLLM's v1 KV connector API).

Start vLLM with ``--kv-transfer-config '{"kv_connector": "KvwarmConnector",
"kv_connector_module_path": "store.engines.vllm", "kv_role": "kv_both", ...}'`` (docs/guides/engines.md).

The class lives in :mod:`store.engines.vllm.connector`, the module that needs vLLM (with
:mod:`store.engines.vllm.prom` and :mod:`store.engines.vllm.cpu_backend`); it is
imported on first use of the name, so that the connector's pure parts (settings, layout,
planning, tenancy, write-back) import, and are tested, where vLLM is not installed.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KvwarmConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvwarmConnector":
        from store.engines.vllm.connector import KvwarmConnector

        return KvwarmConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
