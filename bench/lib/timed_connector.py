"""The shipped ``KvwarmConnector``, each of vLLM's per-step calls into it timed (bench/engine_loop_bench.py).

Runs inside vLLM's engine process (the engine venv, this checkout on ``PYTHONPATH``). Start vLLM with
``kv_connector="TimedKvwarmConnector"`` and ``kv_connector_module_path="bench.lib.timed_connector"``
and the same ``kv_connector_extra_config`` as kvwarm's connector: the subclass changes nothing but
that every hook vLLM calls on either role (:data:`HOOKS`) is timed with ``perf_counter`` and then
runs unchanged, so what is measured is the product's own code.

The seconds add up in :data:`CLOCK`, one per process (both roles share it in vLLM's one-process
mode): a driver in the same process reads :attr:`HookClock.total_s` before and after each engine
step. Where vLLM runs the engine core in its own process (the server), set ``$KVWARM_HOOK_TIMES``
to a file: at shutdown the connector writes the per-hook totals there as JSON.
"""
from __future__ import annotations

import json
import os
from typing import Any

from bench.lib.hook_clock import HookClock
from store.engines.vllm.connector import KvwarmConnector

#: Where the per-hook totals are written at shutdown (for an engine core in another process).
TIMES_ENV = "KVWARM_HOOK_TIMES"

#: Every method vLLM 0.32 calls on a connector while it serves, by role (start-up and shutdown aside).
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups",
                   "register_finished_partial_tail", "on_new_request", "get_loaded_kv_cache_group_ids",
                   "get_external_cache_hit_sources", "has_pending_block_frees", "has_pending_push_work",
                   "take_events", "get_finished_count", "reset_cache")
WORKER_HOOKS = ("bind_connector_metadata", "has_connector_metadata", "clear_connector_metadata",
                "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                "get_finished", "get_transfer_results", "get_block_ids_with_load_errors",
                "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "finish_forward",
                "reset_capture_state")
#: Called by both roles.
SHARED_HOOKS = ("get_kv_connector_stats",)
HOOKS = SCHEDULER_HOOKS + WORKER_HOOKS + SHARED_HOOKS


#: The process's clock (read by bench/lib/loop_driver.py between engine steps).
CLOCK = HookClock()


def _timed_class() -> type:
    attrs: dict[str, Any] = {"__doc__": "``KvwarmConnector`` with every hook in HOOKS timed into CLOCK."}
    for name in HOOKS:
        fn = getattr(KvwarmConnector, name, None)
        if callable(fn):
            attrs[name] = CLOCK.timed(name, fn)

    def shutdown(self: KvwarmConnector) -> None:
        try:
            KvwarmConnector.shutdown(self)
        finally:
            path = os.environ.get(TIMES_ENV)
            if path:
                with open(path, "w") as f:
                    json.dump(CLOCK.snapshot(), f)

    attrs["shutdown"] = shutdown
    return type("TimedKvwarmConnector", (KvwarmConnector,), attrs)


TimedKvwarmConnector = _timed_class()
