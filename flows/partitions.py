"""Scale-out mining: split the request logs into partitions, choose the task runner, merge the reads.

``mine_logs`` fans out over log *partitions*:

- a directory (or bucket prefix) of log files: one partition per file, JSONL files
  first then Parquet, each kind in name order (the order :func:`forecasting.ingest.logs.read_logs`
  reads them in); Hive directories ``date=YYYY-MM-DD[/hour=HH]`` outside ``[start, end)``
  are skipped without being opened;
- one file: ``slices`` consecutive time slices of ``[start, end)`` (both needed), each
  read by its own task (every task parses the whole file and keeps its slice; slicing
  helps when tokenising, not parsing, is the cost).

Each partition is read, validated and tokenised in a task submitted to the task runner
the flow parameter names (:func:`task_runner`: ``threads`` on this machine, ``dask`` on
a local or existing Dask cluster). :func:`merge_reads` joins the partitions' requests in
the order one read of the whole source gives and adds up their read reports; the flow
then mines the union once. The result is therefore exactly the single-partition
result (the tests compare them), which a merge of per-partition demand tables could not
give: a prefix is a candidate when *all* its requests number at least ``k`` and where
they part ways, and a family needs every prompt (MinHash LSH links prompts from any
partition). Reading, validation and tokenisation, the per-row Python work, are what
fan out; the tree, the families and the counts are vectorised and run once.
"""
from __future__ import annotations

import os
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import fsspec
import pandas as pd

from forecasting.ingest.logs import FORMATS, LogError, Quarantined, ReadReport, window_us
from store.errors import BadInputError

RUNNERS = ("threads", "dask")


class PartitionError(BadInputError):
    """The logs cannot be split as asked (the message says what to pass instead)."""


@dataclass(frozen=True)
class Partition:
    """One unit of mining work: the rows of ``source`` with ``start <= timestamp < end``.

    ``kind`` is ``file`` (one file of a directory) or ``slice`` (a time slice of the
    one file every slice reads); ``index`` orders the partitions as one read would.
    """

    source: str
    start: str | None
    end: str | None
    kind: str = "file"
    index: int = 0


@dataclass(frozen=True, eq=False)
class PartitionRead:
    """What a partition task returns: its valid requests (tokenised), its read report
    (quarantine entries in ``report.entries``), where it ran and how long it took."""

    partition: Partition
    requests: pd.DataFrame
    report: ReadReport
    worker: str
    pid: int
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        p = self.partition
        return {"source": p.source, "start": p.start, "end": p.end, "kind": p.kind, "rows_used": self.report.rows_used,
                "rows_quarantined": self.report.rows_quarantined, "worker": self.worker, "pid": self.pid,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True, eq=False)
class MergedRead:
    """The union of the partitions' requests (sorted by time, stable) and their read report."""

    requests: pd.DataFrame
    report: ReadReport
    entries: tuple[Quarantined, ...] = field(default=(), repr=False)


def log_format(path: str) -> str | None:
    """``jsonl`` or ``parquet`` by the file name (:data:`forecasting.ingest.logs.FORMATS`), else None."""
    name = path.lower()
    return next((kind for ext, kind in FORMATS.items() if name.endswith(ext)), None)


def plan_partitions(logs: str, *, start: str | None = None, end: str | None = None, slices: int = 1,
                    skip: str | None = None) -> list[Partition]:
    """The partitions of ``logs`` (see the module docstring); ``skip``: a path never read (the quarantine file).

    Raises:
        PartitionError: ``logs`` is not a path or URL fsspec knows, does not exist, holds no
            log file, is a file of unknown format, or ``slices > 1`` without ``start`` and ``end``.
    """
    if slices < 1:
        raise PartitionError(f"slices must be at least 1, got {slices}")
    try:
        fs, root = fsspec.core.url_to_fs(logs)
    except (ValueError, ImportError) as exc:
        raise PartitionError(f"logs {logs!r} is not a path or URL kvwarm can read ({exc}): pass a local path, "
                             f"file://, s3:// or another fsspec URL (docs/logs.md)") from None
    if not fs.exists(root):
        raise PartitionError(f"logs path {logs!r} does not exist: pass the file or directory of request logs "
                             f"(JSONL or Parquet, docs/logs.md)")
    if fs.isfile(root):
        if log_format(root) is None:
            raise PartitionError(f"logs file {logs!r} has no known log extension: name it "
                                 f"{', '.join(FORMATS)} (docs/logs.md)")
        return _slices(logs, start, end, slices)
    skipped = fsspec.core.url_to_fs(skip)[1] if skip else None
    files = [p for p in sorted(fs.find(root)) if log_format(p) and p != skipped]
    if not files:
        raise PartitionError(f"no log files under {logs!r}: expected names ending in {', '.join(FORMATS)}")
    lo, hi = _bound(start, "start"), _bound(end, "end")
    ordered = [p for p in files if log_format(p) == "jsonl"] + [p for p in files if log_format(p) == "parquet"]
    out = []
    for path in ordered:
        span = _hive_span(path[len(root.rstrip("/")) + 1:])
        if span and ((lo is not None and span[1] <= lo) or (hi is not None and span[0] >= hi)):
            continue
        source = path if "://" not in logs else fs.unstrip_protocol(path)
        out.append(Partition(source, start, end, "file", len(out)))
    return out


def merge_reads(reads: Sequence[PartitionRead], quarantine_path: str | None = None) -> MergedRead:
    """Join the partitions' reads into what one read of the whole source gives.

    Requests: concatenated in partition order, then sorted by time (stable), the order
    :func:`forecasting.ingest.logs.read_logs` produces. Reports: summed for files; for time
    slices of one file every slice read (and quarantined) the same rows, so the rows
    read, quarantined and files come from the first slice and the rows outside the
    window are what no slice used.
    """
    reads = sorted(reads, key=lambda r: r.partition.index)
    if not reads:
        raise PartitionError("no partition to merge: the logs hold no file in the chosen period")
    frames = [r.requests for r in reads if len(r.requests)] or [reads[0].requests]
    requests = pd.concat(frames, ignore_index=True).sort_values("timestamp", kind="stable", ignore_index=True)
    used = sum(r.report.rows_used for r in reads)
    if all(r.partition.kind == "slice" for r in reads):
        first = reads[0].report
        entries = first.entries
        report = ReadReport(first.rows_read, used, first.rows_quarantined,
                            first.rows_read - used - first.rows_quarantined, first.files_read, first.files_unreadable,
                            dict(first.reasons), quarantine_path)
    else:
        reasons: Counter = Counter()
        for r in reads:
            reasons.update(r.report.reasons)
        entries = tuple(e for r in reads for e in r.report.entries)
        report = ReadReport(sum(r.report.rows_read for r in reads), used,
                            sum(r.report.rows_quarantined for r in reads),
                            sum(r.report.rows_filtered for r in reads), sum(r.report.files_read for r in reads),
                            sum(r.report.files_unreadable for r in reads), dict(reasons), quarantine_path)
    return MergedRead(requests, report, tuple(entries))


def task_runner(kind: str, *, address: str | None = None, workers: int = 2) -> Any:
    """The Prefect task runner the partition tasks are submitted to.

    Args:
        kind: ``threads`` (a thread pool in this process) or ``dask`` (prefect-dask's
            ``DaskTaskRunner``).
        address: with ``dask``, the scheduler of an existing cluster (``tcp://host:8786``);
            without it a temporary ``LocalCluster`` of ``workers`` processes is started
            for the run and stopped after it.
        workers: threads, or the temporary cluster's worker processes.

    Raises:
        PartitionError: an unknown ``kind``, ``workers`` below 1, or ``address`` without ``dask``.
    """
    if kind not in RUNNERS:
        raise PartitionError(f"task_runner {kind!r} is not one of {', '.join(RUNNERS)}")
    if workers < 1:
        raise PartitionError(f"workers must be at least 1, got {workers}")
    if kind == "threads":
        if address:
            raise PartitionError("dask_address is only used with task_runner='dask'")
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if address:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None})


def where() -> tuple[str, int]:
    """Where this code runs: the Dask worker's address, else ``host/thread``; and the process id."""
    try:
        from distributed import get_worker

        return f"dask:{get_worker().address}", os.getpid()
    except (ImportError, ValueError):
        return f"{socket.gethostname()}/{threading.current_thread().name}", os.getpid()


def _slices(logs: str, start: str | None, end: str | None, slices: int) -> list[Partition]:
    if slices == 1:
        return [Partition(logs, start, end, "file", 0)]
    if start is None or end is None:
        raise PartitionError(f"slicing one log file into {slices} time slices needs both start and end; "
                             f"pass them, or split the logs into files (a directory is read one file per task)")
    _bound(start, "start"), _bound(end, "end")
    lo, hi = pd.Timestamp(start), pd.Timestamp(end)
    if hi <= lo:
        raise PartitionError(f"start ({start}) must be before end ({end})")
    edges = [start] + [(lo + (hi - lo) * i / slices).isoformat() for i in range(1, slices)] + [end]
    return [Partition(logs, edges[i], edges[i + 1], "slice", i) for i in range(slices)]


def _bound(value: str | None, name: str) -> int | None:
    try:
        return window_us(value)
    except LogError:
        raise PartitionError(f"{name} {value!r} is not a time: use ISO 8601, e.g. 2026-03-04T00:00") from None


def _hive_span(relative: str) -> tuple[int, int] | None:
    """The microsecond span of a ``date=YYYY-MM-DD[/hour=HH]`` path, or None when it names none."""
    keys = dict(part.split("=", 1) for part in relative.split("/")[:-1] if "=" in part)
    if "date" not in keys:
        return None
    try:
        begin = pd.Timestamp(keys["date"])
        length = pd.Timedelta(days=1)
        if "hour" in keys:
            begin, length = begin + pd.Timedelta(hours=int(keys["hour"])), pd.Timedelta(hours=1)
    except (ValueError, TypeError):
        return None
    us = int(begin.value // 1000)
    return us, us + int(length.value // 1000)


