"""What vLLM 0.32 makes of ``cudagraph_mode`` with a KV connector: run with the engine venv's python
(``python -m tests.store.engines.vllm.cudagraph_probe CONNECTOR MODULE_PATH EXTRA_JSON ...``); prints one
JSON line.

For each connector (a name, the module vLLM loads it from, ``-`` for vLLM's own, and its
``kv_connector_extra_config``), it builds a real
``VllmConfig`` asking for ``FULL_AND_PIECEWISE`` graphs (the default on CUDA) under ``VLLM_COMPILE``,
and reports every value vLLM's own code assigns to ``compilation_config.cudagraph_mode`` while it
builds the config (the value, and the vLLM file and function that assigned it), and the final mode.

vLLM's CPU platform answers ``support_static_graph_mode() -> False``, and then ``VllmConfig.__post_init__``
skips its whole CUDA-graph block (the connector's override with it) and sets ``NONE``. The probe sets
that one platform answer to CUDA's (``True``) so that vLLM runs that block, the connector override
included, on this machine; everything else is vLLM's CPU platform, whose later hook moves the compile
mode off ``VLLM_COMPILE`` (so vLLM then drops piecewise graphs too: the final mode differs from CUDA's,
and the assignments show each step).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any


def probe(connector: str, module_path: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``cudagraph_mode`` assignments and final mode of one config with ``connector``."""
    import vllm
    from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    root = os.path.dirname(vllm.__file__)
    assigned: list[list[str]] = []
    setter = CompilationConfig.__setattr__

    def watch(self: Any, name: str, value: Any) -> None:
        if name == "cudagraph_mode":
            frame = sys._getframe(1)
            assigned.append([getattr(value, "name", str(value)), os.path.relpath(frame.f_code.co_filename, root),
                             frame.f_code.co_name])
        setter(self, name, value)

    CompilationConfig.__setattr__ = watch  # type: ignore[method-assign]
    try:
        transfer = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module_path,
                                    kv_role="kv_both", kv_connector_extra_config=extra)
        compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="FULL_AND_PIECEWISE")
        assigned.clear()  # from here on, vLLM's own post-init
        config = VllmConfig(kv_transfer_config=transfer, compilation_config=compilation)
    finally:
        CompilationConfig.__setattr__ = setter  # type: ignore[method-assign]
    final = config.compilation_config.cudagraph_mode
    return {"connector": connector, "assigned": assigned, "final": final.name,
            "final_has_full": bool(final.has_full_cudagraphs())}


def main(argv: list[str]) -> None:
    from vllm.platforms import current_platform

    platform = type(current_platform)
    platform.support_static_graph_mode = classmethod(lambda cls: True)  # CUDA's answer (see the module docstring)
    runs = [probe(name, None if path == "-" else path, json.loads(extra))
            for name, path, extra in zip(argv[0::3], argv[1::3], argv[2::3])]
    print(json.dumps({"platform": platform.__name__, "runs": runs}))


if __name__ == "__main__":
    main(sys.argv[1:])
