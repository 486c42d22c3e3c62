"""The connector's vLLM-facing modules, where vLLM is installed (``make test`` runs this file in ``.venv-engine``).

In the project's ``.venv`` vLLM is absent, so ``connector.py`` and ``prom.py`` cannot be
imported there (tests/test_errors.py leaves them out): this file checks them in the engine
venv, without starting an engine. Every module of ``store.engines.vllm`` imports beside
vLLM, the errors they define are kvwarm errors of one kind, the class vLLM loads by name is
one of vLLM's v1 connectors, and the stats dict vLLM carries between processes round-trips
through the connector's own ``KVConnectorStats``.
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest

vllm = pytest.importorskip("vllm")

from store.errors import BadInputError, KvwarmError, OperationalError  # noqa: E402

PACKAGE = "store.engines.vllm"


def modules() -> list[str]:
    package = importlib.import_module(PACKAGE)
    return [PACKAGE, *(f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(package.__path__))]


def test_every_module_of_the_connector_imports_beside_vllm_and_its_errors_are_of_one_kind():
    names = modules()
    assert {f"{PACKAGE}.connector", f"{PACKAGE}.prom"} <= set(names)
    for name in names:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                where = f"{name}.{obj.__name__}"
                assert issubclass(obj, KvwarmError), f"{where} does not derive from KvwarmError"
                assert issubclass(obj, BadInputError) != issubclass(obj, OperationalError), f"{where}: one kind"


def test_the_class_vllm_loads_by_name_is_a_v1_connector_whose_stats_round_trip():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from store.engines.vllm import KvwarmConnector

    assert issubclass(KvwarmConnector, KVConnectorBase_V1)
    stats = KvwarmConnector.build_kv_connector_stats({"lookups": 3, "misses:absent": 1})
    more = KvwarmConnector.build_kv_connector_stats({"lookups": 2, "misses:absent": 1, "hits": 1})
    total = stats.aggregate(more)
    assert not total.is_empty()
    assert total.data["lookups"] == 5 and total.data["misses:absent"] == 2 and total.data["hits"] == 1
    assert KvwarmConnector.build_kv_connector_stats({}).is_empty()


def _isas() -> list[str]:
    """The CPU cache kernel's ISAs this CPU runs (vec everywhere; amx where the CPU has AMX)."""
    import torch

    out = ["vec"]
    if hasattr(torch.cpu, "_is_amx_tile_supported") and torch.cpu._is_amx_tile_supported():
        out.append("amx")
    return out


@pytest.mark.parametrize("isa", _isas())
def test_the_kernel_writer_writes_what_the_probed_order_says_for_a_slice_of_heads(isa):
    import torch

    from store.engines.vllm.cpu_backend import cpu_block_writer, probe_order
    from store.engines.vllm.layout import EngineLayout
    from store.engines.vllm.paging import read_layer, write_layer

    H, B, D, NB = 4, 128, 32, 12
    layout = EngineLayout("cpu_permuted", NB, 2, B, D, torch.bfloat16, index=probe_order(isa, 2, B, D, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(H, 3 * B, D, generator=g).to(torch.bfloat16)[1:3]  # heads 1-2 of 4: a view, as a TP rank reads
    v = torch.randn(H, 3 * B, D, generator=g).to(torch.bfloat16)[1:3]
    by_kernel, by_index = (torch.zeros(NB, 2, B, 2 * D, dtype=torch.bfloat16) for _ in range(2))
    cpu_block_writer(isa)(by_kernel, [7, 2, 9], k, v)
    write_layer(by_index, layout, [7, 2, 9], k.contiguous(), v.contiguous())
    assert torch.equal(by_kernel, by_index)
    rk, rv = read_layer(by_kernel, layout, [7, 2, 9])
    assert torch.equal(rk, k) and torch.equal(rv, v)
    with pytest.raises(ValueError, match="do not fill"):
        cpu_block_writer(isa)(by_kernel, [1], k, v)


def test_kvwarm_is_a_best_effort_cache_so_a_preemption_keeps_the_requests_output():
    """vLLM's default ``requires_kv_delivery`` is the producer role (true for ``kv_both``, the role kvwarm
    runs in): the scheduler would then drop a preempted request's in-flight output as for a hand-off."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from store.engines.vllm import KvwarmConnector

    conn = KvwarmConnector.__new__(KvwarmConnector)  # the property reads no state: no engine is started
    conn._kv_transfer_config = KVTransferConfig(kv_connector="KvwarmConnector", kv_role="kv_both",
                                                kv_connector_module_path="store.engines.vllm")
    assert KVConnectorBase_V1.requires_kv_delivery.fget(conn) is True  # what kvwarm overrides
    assert conn.requires_kv_delivery is False


def test_a_caches_layer_number_is_vllms_and_a_name_without_one_is_refused_naming_it():
    from store.engines.vllm.connector import layer_index
    from store.engines.vllm.settings import ConnectorConfigError

    assert layer_index("model.layers.16.self_attn.attn") == 16
    assert layer_index("language_model.model.layers.3.self_attn.attn") == 3
    for name in ("model.norm.attn", "model.encoder.layers.0.sub.1"):  # none, or two
        with pytest.raises(ConnectorConfigError, match=f"the KV cache '{name}' names no single layer number"):
            layer_index(name)


@pytest.mark.parametrize("method, draft_kv", [
    *[(m, False) for m in ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")],
    *[(m, True) for m in ("eagle", "eagle3", "mtp", "draft_model", "dflash", "extract_hidden_states")],
])
def test_the_speculative_methods_refused_are_those_whose_draft_keeps_kv_in_vllm(method, draft_kv):
    # vLLM's own predicate (what the connector asks) on its config class; the docs and NO_DRAFT_KV list these
    from vllm.config import SpeculativeConfig

    from store.engines.vllm.parallel import NO_DRAFT_KV

    cfg = object.__new__(SpeculativeConfig)  # only `method` is read: no draft model to load
    object.__setattr__(cfg, "method", method)
    assert cfg.uses_draft_kv_cache() is draft_kv
    assert (method in NO_DRAFT_KV) is not draft_kv
