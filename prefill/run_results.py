"""Reading back what a pipeline run left behind: its stages' JSON results and the loaders' stats dumps.

The I/O edge of the monitoring: :func:`read_run` reads a run directory's results
(:class:`prefill.rundir.RunDir`), :func:`read_loader_stats` the serving loaders' stats
dumps (:meth:`store.serving.loader.KVLoader.stats` saved as JSON), both checked, and
:func:`monitoring_for_run` hands them to :func:`prefill.monitoring.compute`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from prefill.monitoring import Monitoring, MonitoringError, Prices, compute
from prefill.rundir import RESULTS, RunDir, RunDirError


def read_run(run: RunDir) -> dict[str, dict[str, Any]]:
    """The run's JSON results by stage name (:data:`prefill.rundir.RESULTS`; absent ones left out).

    Raises:
        MonitoringError: the directory does not exist, or a file is not a JSON object.
    """
    if not run.path.is_dir():
        raise MonitoringError(f"no run directory {run.path}: the kvwarm pipeline writes it (the kvwarm-pipeline flow "
                              f"with this store and run, or `python -m flows.demo --store ...`); check --store and "
                              f"--run")
    out: dict[str, dict[str, Any]] = {}
    for stage in RESULTS:
        p = run.result(stage)
        if p.exists():
            out[stage] = _json_object(p, f"the {stage} stage's result")
    return out


def read_loader_stats(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Loader stats dumps (``KVLoader.stats()`` as JSON), checked.

    Raises:
        MonitoringError: a file is missing, not JSON, or lacks the counters of ``stats()``.
    """
    out = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise MonitoringError(f"loader stats file {p} does not exist: save `json.dumps(loader.stats())` from the "
                                  f"serving process (see docs/monitoring.md)")
        d = _json_object(p, "a loader stats dump")
        missing = [k for k in ("lookups", "hits", "tokens_served") if not isinstance(d.get(k), (int, float))]
        if missing:
            raise MonitoringError(f"{p} is not a KVLoader.stats() dump: it lacks the number(s) {missing}")
        out.append(d)
    return out


def _json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MonitoringError(f"{path} ({what}) is unreadable or not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MonitoringError(f"{path} ({what}) holds a {type(obj).__name__}, expected a JSON object")
    return obj


def monitoring_for_run(store_url: str, run: str, loader_stats: Sequence[str | os.PathLike[str]] = (),
                       prices: Prices = Prices()) -> Monitoring:
    """Read run ``run`` of ``store_url`` and the stats dumps, compute the families (:func:`prefill.monitoring.compute`).

    Raises:
        MonitoringError: a bad run name or store URL, a missing run, or a malformed file.
    """
    try:
        directory = RunDir.of(store_url, run)
    except RunDirError as exc:
        raise MonitoringError(str(exc)) from None
    return compute(run, read_run(directory), read_loader_stats(loader_stats), prices)
