"""With kvwarm's connector, vLLM 0.32's own config turns full CUDA graphs into piecewise ones.

A real ``VllmConfig`` is built in the engine venv (:mod:`tests.store.engines.vllm.cudagraph_probe`, a
subprocess with its python, no engine started) with ``cudagraph_mode=FULL_AND_PIECEWISE`` and a
``kv_transfer_config`` naming ``KvwarmConnector`` as vLLM loads it (by name, from
``store.engines.vllm``), once more naming vLLM's own ``ExampleConnector``, which keeps the base
class's answer (no piecewise needed), to show what the override changes, and once with kvwarm's
``load_mode: off`` (write-back alone: no layer waits, so no override). What is read back is the
mode vLLM's own ``__post_init__`` assigns, and its own log line saying why.

vLLM's CPU platform would skip that code (``support_static_graph_mode()`` is ``False`` there: the mode
becomes ``NONE`` before any connector is asked). The probe gives that one platform answer CUDA's value,
so that vLLM's CUDA-graph block, its connector override included, runs here on a real config. The
CPU platform then moves the compile mode off ``VLLM_COMPILE`` and vLLM drops piecewise graphs as well
(``NONE``); on CUDA the mode stays ``PIECEWISE``. Either way no full graph is left with kvwarm, while
with ``ExampleConnector`` full decode graphs are (``FULL_DECODE_ONLY``), in which a layer wait would
never run.
"""
from __future__ import annotations

import json
import os
import subprocess

from bench.lib.vllm_engine import ROOT

PROBE = "tests.store.engines.vllm.cudagraph_probe"


def test_vllm_turns_full_cuda_graphs_into_piecewise_for_kvwarm_and_not_for_a_connector_that_does_not_ask(
        engine) -> None:
    cmd = [str(engine), "-m", PROBE]
    for name, path, extra in (("KvwarmConnector", "store.engines.vllm", {"load_mode": "sync"}),
                              ("ExampleConnector", "-", {}),
                              ("KvwarmConnector", "store.engines.vllm", {"load_mode": "off"})):
        cmd += [name, path, json.dumps(extra)]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"the probe failed:\n{done.stdout}\n{done.stderr}"
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["platform"] == "CpuPlatform"
    ours, theirs, no_loads = got["runs"]
    # vLLM's connector override (config/vllm.py, __post_init__) asks the class vLLM loaded by name, and says so
    assert ours["assigned"][0] == ["PIECEWISE", "config/vllm.py", "__post_init__"]
    assert ("KV connector KvwarmConnector requires PIECEWISE CUDA graph mode" in done.stderr + done.stdout
            and "Overriding cudagraph_mode from FULL_AND_PIECEWISE to PIECEWISE" in done.stderr + done.stdout)
    assert not ours["final_has_full"] and ours["final"] in ("PIECEWISE", "NONE")
    # without the override, vLLM keeps full graphs (for decode batches): wait_for_layer_load would never run
    assert not any(mode == "PIECEWISE" for mode, _, _ in theirs["assigned"])
    assert theirs["final_has_full"] and theirs["final"] == "FULL_DECODE_ONLY"
    # kvwarm with load_mode off (write-back alone) waits for no layer: it leaves vLLM's graphs as they are
    assert no_loads["assigned"] == theirs["assigned"] and no_loads["final"] == "FULL_DECODE_ONLY"
