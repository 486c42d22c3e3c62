"""What every engine driver shares: barriers with the caller, the result file written whole, and a main
that writes the result whatever happened (:mod:`bench.lib.vllm_driver`, ``loop_driver``, ``miss_driver``,
``writeback_driver``)."""
from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any, Callable


def barrier(result_path: str, name: str, timeout_s: float = 600) -> None:
    """Say this step is reached (``RESULT.NAME.reached``) and wait for ``RESULT.NAME.go``.

    The caller does something to the world between two steps (stops the S3 server, say).
    """
    open(f"{result_path}.{name}.reached", "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(f"{result_path}.{name}.go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: no go within {timeout_s} s")
        time.sleep(0.05)


def write_result(result: dict[str, Any], result_path: str) -> None:
    """The result file, replaced whole (its reader sees the old one or the new one, never half)."""
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)


def drive(run: Callable[[dict[str, Any], dict[str, Any]], None], spec_path: str, result_path: str,
          result: dict[str, Any]) -> int:
    """A driver's main: ``run(spec, result)``, then the result written whatever happened (with the
    traceback under ``error`` when it raised); the exit status."""
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        run(spec, result)
    except BaseException:  # noqa: BLE001 - the result, with the traceback, must still be written
        result["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        write_result(result, result_path)
    return 1 if result["error"] else 0
