"""A KV connector that does nothing: vLLM's connector plumbing alone (the engine-loop bench's third arm).

With any connector configured, vLLM calls its hooks every step: metadata bound and cleared,
``start_load_kv``, ``wait_for_layer_load`` and ``save_kv_layer`` around each attention layer,
``wait_for_save``, ``build_connector_meta``, and more. :class:`EmptyConnector` answers each at once (no
KV matched, nothing saved), so an engine with it measures what having a connector costs vLLM before
the connector does any work; kvwarm's figures beside it say what kvwarm itself adds. Runs inside the
engine venv (``kv_connector="EmptyConnector"``, ``kv_connector_module_path="bench.lib.empty_connector"``).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class EmptyConnector(KVConnectorBase_V1):
    """Every hook a no-op: nothing is loaded or saved."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
