"""The run directory: where a run of the pipeline keeps its files, and the name of every file in it.

Each stage flow (``flows/``) reads what earlier stages wrote and writes its own results
under the store's first (local) tier, ``<local tier>/_flows/<run>/``, so that a stage can
run on its own and ``prefill report`` can read a run back. This module is the one place
that names that directory and its files; it reads and writes none of them (the flows
write them, :mod:`prefill.run_results` reads the JSON results back):

- ``demand/{series,total,prefixes,families}.parquet``, ``demand/meta.json``, ``mine.json``,
  ``quarantine.jsonl``: mining;
- ``forecast.parquet``, ``total_forecast.parquet``, ``window.json``: forecasting;
- ``plan.json``: planning (the :mod:`store.plan` format); ``cadence_plan.json``: the latest
  short plan (``flows/cadence.py``); ``prefill.json``: the prefill job's report (a sharded
  prefill's: every shard's), ``prefill-shard-<i>.json``: one shard's; ``gc.json``: garbage
  collection; ``audit.json``: the KV audit that ran with it (``flows/audit.py``);
- ``report.json``, ``forecast.png``, ``offpeak.png``: the report;
- ``loader_stats/*.json``: the serving loaders' stats dumps (docs/guides/monitoring.md);
- ``replay_outcomes.parquet``, ``hitrate.png``, ``pool/``, ``cold_store/``: the demo's replay;
  ``whatif-restart.png``, ``whatif-replacement.png``: its what-if (``flows/whatif.py``).

The store itself knows nothing of runs: a run directory is metadata beside the
snapshots, under a name (``_flows``) that no tenant's objects use.

A run directory is the pipeline's private workspace, never a serving node's: the demand
tables, the quarantine and the plans hold the tenants' prompts. The plans' entries of a
tenant with an encryption key are sealed with it (:mod:`store.plan_seal`); everything else
is plain text. What serving nodes read is the published plan in the store's metadata area,
which names blocks by salted key only (:mod:`store.published_plan`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from store.errors import BadInputError, ConfigError
from store.tiers.urls import file_root

#: the folder of the local tier that holds every run's directory
RUNS_FOLDER = "_flows"
#: the stages whose result is one JSON object in the run directory, ``<stage>.json``, in pipeline order
RESULTS = ("mine", "plan", "prefill", "gc", "audit", "report")
#: the demand tables mining writes (``demand/<name>.parquet``)
DEMAND_TABLES = ("series", "total", "prefixes", "families")


class RunDirError(BadInputError):
    """A run name or store URL that cannot name a run directory; the message says what to pass."""


def check_run_name(run: str) -> str:
    """``run`` if it can name a directory (non-empty, no ``/``, not starting with ``.``).

    Raises:
        RunDirError: it cannot.
    """
    if not isinstance(run, str) or not run or "/" in run or run.startswith("."):
        raise RunDirError(f"run name {run!r} must be a non-empty name without '/' (it names a directory)")
    return run


def local_root(store_url: str) -> Path:
    """The directory of the store's first tier, which must be ``file://`` (runs are kept there).

    Raises:
        RunDirError: the first tier is not ``file://``, or names a relative directory.
    """
    first = store_url.split(",")[0].strip()
    if not first.startswith("file://"):
        raise RunDirError(f"store url {store_url!r} has no local tier first; runs are kept under it: "
                          f"use file:///DIR or file:///DIR,s3://bucket/prefix")
    try:
        root = file_root(first)
    except ConfigError as exc:
        raise RunDirError(str(exc)) from None
    return Path(os.path.expanduser(root)).resolve()


@dataclass(frozen=True)
class RunDir:
    """The directory of one run, ``<local tier>/_flows/<run>``, and the path of every file in it."""

    path: Path

    @classmethod
    def of(cls, store_url: str, run: str) -> RunDir:
        """Run ``run`` of store ``store_url``.

        Raises:
            RunDirError: a bad run name, or a store URL without a ``file://`` tier first.
        """
        return cls(local_root(store_url) / RUNS_FOLDER / check_run_name(run))

    @property
    def name(self) -> str:
        """The run's name."""
        return self.path.name

    def others(self) -> list[RunDir]:
        """The store's other runs (the directories beside this one), in no particular order."""
        root = self.path.parent
        if not root.is_dir():
            return []
        return [RunDir(d) for d in root.iterdir() if d.name != self.name and d.is_dir()]

    def result(self, stage: str) -> Path:
        """``<stage>.json``, the JSON result of one of :data:`RESULTS`."""
        if stage not in RESULTS:
            raise ValueError(f"no stage {stage!r} writes a JSON result; the stages are {', '.join(RESULTS)}")
        return self.path / f"{stage}.json"

    # -- mining
    @property
    def demand(self) -> Path:
        """The folder of the demand tables."""
        return self.path / "demand"

    def demand_table(self, name: str) -> Path:
        """``demand/<name>.parquet``, one of :data:`DEMAND_TABLES`."""
        if name not in DEMAND_TABLES:
            raise ValueError(f"no demand table {name!r}; the tables are {', '.join(DEMAND_TABLES)}")
        return self.demand / f"{name}.parquet"

    @property
    def demand_meta(self) -> Path:
        """``demand/meta.json``: the demand's bucket."""
        return self.demand / "meta.json"

    @property
    def mine(self) -> Path:
        """``mine.json``: what mining read and found, and the similarity threshold it used."""
        return self.result("mine")

    @property
    def quarantine(self) -> Path:
        """``quarantine.jsonl``: the malformed log rows, each with its reason (the default place)."""
        return self.path / "quarantine.jsonl"

    # -- forecasting
    @property
    def forecast(self) -> Path:
        """``forecast.parquet``: every prefix's forecast."""
        return self.path / "forecast.parquet"

    @property
    def total_forecast(self) -> Path:
        """``total_forecast.parquet``: the total load's forecast."""
        return self.path / "total_forecast.parquet"

    @property
    def window(self) -> Path:
        """``window.json``: the chosen off-peak window and the windows under the threshold."""
        return self.path / "window.json"

    # -- planning, prefill, GC
    @property
    def plan(self) -> Path:
        """``plan.json``: the plan (:mod:`store.plan`), an encrypted tenant's entries sealed."""
        return self.result("plan")

    @property
    def cadence_plan(self) -> Path:
        """``cadence_plan.json``: the latest short plan, remade every few minutes (:mod:`store.plan`)."""
        return self.path / "cadence_plan.json"

    @property
    def prefill(self) -> Path:
        """``prefill.json``: the prefill job's report."""
        return self.result("prefill")

    def shard_result(self, index: int) -> Path:
        """``prefill-shard-<index>.json``: one shard's report, written by its flow run (the parent reads them all)."""
        return self.path / f"prefill-shard-{int(index)}.json"

    @property
    def gc(self) -> Path:
        """``gc.json``: what garbage collection removed."""
        return self.result("gc")

    @property
    def audit(self) -> Path:
        """``audit.json``: what the KV audit checked and quarantined (``prefill.audit.AuditReport.as_dict``)."""
        return self.result("audit")

    # -- the report
    @property
    def report(self) -> Path:
        """``report.json``: the run's summary, with the monitoring families."""
        return self.result("report")

    @property
    def forecast_plot(self) -> Path:
        """``forecast.png``."""
        return self.path / "forecast.png"

    @property
    def offpeak_plot(self) -> Path:
        """``offpeak.png``."""
        return self.path / "offpeak.png"

    # -- serving, and the demo's replay
    @property
    def loader_stats(self) -> Path:
        """``loader_stats/``: the serving loaders' stats dumps, ``<name>.json`` each."""
        return self.path / "loader_stats"

    def loader_stats_files(self) -> list[Path]:
        """The stats dumps kept with the run, sorted by name (none when the folder is absent)."""
        return sorted(self.loader_stats.glob("*.json"))

    @property
    def replay_outcomes(self) -> Path:
        """``replay_outcomes.parquet``: one row per replayed request (the demo)."""
        return self.path / "replay_outcomes.parquet"

    @property
    def hitrate_plot(self) -> Path:
        """``hitrate.png``: the replay's hit rate over time (the demo)."""
        return self.path / "hitrate.png"

    @property
    def pool(self) -> Path:
        """``pool/``: the replay loaders' pool files (the demo)."""
        return self.path / "pool"

    @property
    def cold_store(self) -> Path:
        """``cold_store/``: the replay's reactive baseline store (the demo)."""
        return self.path / "cold_store"
