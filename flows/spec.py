"""The run spec: every knob of the pipeline's flows, as frozen pydantic sections validated before a run starts.

Prefect validates a flow's parameters with pydantic and shows a model parameter as a
form, so the flows take their knobs in these sections instead of long keyword lists:

- :class:`RunTarget` (``target``): which run of which store, with which config, model and
  block size; every stage takes it, and every stage of one run must share it;
- :class:`MiningSpec` (``mining``): the logs, the period and how prefixes are mined;
- :class:`RunnerSpec` (``runner``): where mining's partition tasks run;
- :class:`ForecastSpec` (``forecast``): the horizon and the off-peak window;
- :class:`PlanSpec` (``plan``): the planner's prefill rate and budgets, and the prefill
  deployment to schedule at the window's start;
- :class:`CadenceSpec` (``cadence``): how often the short plans are made (default every
  5 minutes), what they learn from and what they may retain (``plan_cadence``);
- :class:`PrefillSpec` (``prefill``): the prefill job's device and dtype, and its shards;
- :class:`AuditSpec` (``audit``): the KV audit the maintenance flow (``gc_store``) runs after GC,
  within a budget of compute seconds (off by default);
- :class:`MonitoringSpec` (``monitoring``): the GPU price of the report's economics;
- :class:`StagesSpec` (``stages``): which optional stages the pipeline runs.

:class:`RunSpec` holds them all for :func:`flows.pipeline.kvwarm_pipeline`, which passes
each stage flow ``target`` and that stage's sections; a deployment per stage
(``prefect.yaml``) sets only its own. A bad value is refused before any work, by a
message that names the field (``mining.bucket``, ``plan.budget_gpu_s``); so is an unknown
key, so a misspelt knob in a deployment is an error rather than a default silently used.
The validators raise :class:`store.errors.BadInputError` (a ``ValueError``), which
pydantic reports as that field's error in its ``ValidationError``.
"""
from __future__ import annotations

import re
import time
from typing import Literal, Optional, Union

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forecasting.planning.cadence import CADENCE_MINUTES
from prefill.agreement import TOLERANCE
from prefill.models import DEFAULT_MODEL
from prefill.rundir import check_run_name, local_root
from store.errors import BadInputError
from store.identity.tenant import check_tenant_name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def default_run_name() -> str:
    """``run-<UTC time>``: the name of a pipeline run that was given none."""
    return time.strftime("run-%Y%m%dT%H%M%S", time.gmtime())


class RunTarget(_Section):
    """Which run of which store, with which config, model and block size: what every stage shares."""

    store: str = Field(description="Store URL, tiers fastest first: file:///DIR[,s3://bucket/prefix]. The first "
                                   "tier must be file:// when a run is named: the run's files live under it.")
    run: Optional[str] = Field(None, description="Run name; every stage of one run uses the same one. The "
                                                 "pipeline names a new run run-<UTC time> when none is given.")
    config_path: Optional[str] = Field(None, description="kvwarm config file (default $KVWARM_CONFIG, else the "
                                                         "built-in defaults; docs/reference/config.md).")
    model: str = Field(DEFAULT_MODEL, min_length=1, description="Model name, directory or Hugging Face id.")
    block_size: Optional[int] = Field(None, ge=1, le=65536,
                                      description="Tokens per block, replacing the config's kv_cache.block_size "
                                                  "(None: the config's); the same in every stage.")

    @model_validator(mode="after")
    def _names_a_run_directory(self) -> RunTarget:
        if self.run is not None:  # a RunDirError is a BadInputError: pydantic names the field
            check_run_name(self.run)
            local_root(self.store)
        return self

    def with_run(self, run: str) -> RunTarget:
        """The same target for run ``run`` (validated)."""
        return RunTarget.model_validate({**self.model_dump(), "run": run})


def _time_bound(value: Optional[str], field: str) -> Optional[str]:
    if value is None:
        return None
    try:
        ts = pd.Timestamp(value)
    except (ValueError, TypeError) as exc:
        raise BadInputError(f"{field} {value!r} is not a time ({exc}): use ISO 8601, e.g. '2026-03-04' or "
                         f"'2026-03-04T06:00:00Z'") from None
    if ts is pd.NaT:
        raise BadInputError(f"{field} {value!r} is not a time: use ISO 8601, e.g. '2026-03-04'")
    return value


class MiningSpec(_Section):
    """The request logs, the period mined and how reused prefixes are found (``mine_logs``)."""

    logs: str = Field(min_length=1, description="Request logs: a file, a directory or an fsspec URL (docs/reference/logs.md).")
    bucket: str = Field("1h", description="Demand bucket, a duration: '1h', '15min', '1D'.")
    k: int = Field(3, ge=1, description="A prefix needs at least k distinct requests.")
    start: Optional[str] = Field(None, description="First time mined (ISO 8601; default: the logs' first).")
    end: Optional[str] = Field(None, description="End of the mined period, excluded (ISO 8601; default: the "
                                                 "logs' last): the training data ends here.")
    similarity: Optional[float] = Field(None, ge=0.5, le=1.0,
                                        description="MinHash LSH threshold of the families (default: adapted from "
                                                    "the last measured run, else the config's).")
    quarantine: Optional[str] = Field(None, description="Where malformed rows go (default: the run's "
                                                        "quarantine.jsonl).")
    slices: int = Field(1, ge=1, description="Time slices of a single log file, read as separate partitions.")

    @field_validator("bucket")
    @classmethod
    def _positive_duration(cls, bucket: str) -> str:
        try:
            step = pd.Timedelta(bucket)
        except (ValueError, TypeError):
            step = None
        if step is None or pd.isna(step) or step <= pd.Timedelta(0):
            raise BadInputError(f"bucket {bucket!r} is not a positive duration: use e.g. '1h', '15min' or '1D'")
        return bucket

    @field_validator("start", "end")
    @classmethod
    def _a_time(cls, value: Optional[str], info) -> Optional[str]:  # type: ignore[no-untyped-def]
        return _time_bound(value, info.field_name)

    @model_validator(mode="after")
    def _ordered(self) -> MiningSpec:
        if self.start is not None and self.end is not None and pd.Timestamp(self.start) >= pd.Timestamp(self.end):
            raise BadInputError(f"start {self.start!r} is not before end {self.end!r}: nothing would be mined")
        return self


class RunnerSpec(_Section):
    """Where mining's partition tasks run (``flows.partitions.task_runner``)."""

    task_runner: Literal["threads", "dask"] = Field("threads", description="threads here, or a Dask cluster.")
    dask_address: Optional[str] = Field(None, description="With dask: the scheduler of an existing cluster "
                                                          "(tcp://host:8786); without it a temporary local one.")
    parallelism: int = Field(2, ge=1, description="Threads, or the temporary Dask cluster's worker processes.")

    @model_validator(mode="after")
    def _address_needs_dask(self) -> RunnerSpec:
        if self.dask_address and self.task_runner != "dask":
            raise BadInputError("dask_address is only used with task_runner 'dask'")
        return self


class ForecastSpec(_Section):
    """How far to forecast, and the off-peak window to look for (``forecast_demand``)."""

    horizon: int = Field(24, ge=1, description="Buckets forecast ahead.")
    workers: int = Field(1, ge=1, description="Forecasting processes.")
    window_hours: float = Field(3.0, gt=0, description="Length of the prefill window.")
    offpeak_fraction: float = Field(0.6, gt=0, le=1.0, description="Off-peak threshold, a fraction of the "
                                                                   "forecast peak.")


class PlanSpec(_Section):
    """The planner's prefill rate and budgets, and the prefill to schedule (``plan_prewarm``)."""

    prefill_tokens_per_s: Optional[float] = Field(None, gt=0, description="Prefill rate the GPU seconds are "
                                                                          "budgeted at (default: the last measured "
                                                                          "for the model, else 2,000).")
    budget_gpu_s: float = Field(3600.0, ge=0, description="GPU seconds of prefill the plan may spend.")
    budget_store_bytes: float = Field(float(1 << 30), ge=0, description="Store bytes the plan may fill.")
    gpu_s_per_gib_hour: float = Field(0.5, ge=0, description="Storage price, in GPU seconds per GiB-hour.")
    schedule_prefill: Optional[str] = Field(None, description="A prefill deployment, FLOW/DEPLOYMENT (e.g. "
                                                              "prefill-plan/prefill-offpeak), to schedule at the "
                                                              "window's start.")

    @field_validator("schedule_prefill")
    @classmethod
    def _a_deployment(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
            raise BadInputError(f"schedule_prefill {name!r} must name a deployment as FLOW/DEPLOYMENT, e.g. "
                             f"'prefill-plan/prefill-offpeak'")
        return name


class CadenceSpec(_Section):
    """The short plans (``plan_cadence``): stored prefixes to prefetch and retain, remade every ``minutes``."""

    minutes: float = Field(CADENCE_MINUTES, gt=0, le=1440, description="Minutes between short plans: the cadence deployment "
                                                           "runs this often, a new replica prefetches a plan at most "
                                                           "this old, and a plan counts the uses it expects within "
                                                           "this (the reuse model's horizon).")
    lookback_minutes: float = Field(60.0, gt=0, description="Minutes of logs before the plan's time it learns from.")
    node_bytes: float = Field(float(1 << 38), ge=0, description="Bytes a plan may retain on a serving node's tier.")
    store_bytes: Optional[float] = Field(None, ge=0, description="Bytes of the store a plan may retain (None: no "
                                                                 "limit beyond node_bytes).")
    prefill_tokens_per_s: Optional[float] = Field(None, gt=0, description="Prefill rate the seconds a hit saves are "
                                                                          "priced at (default: the last measured for "
                                                                          "the model, else 2,000).")


class PrefillSpec(_Section):
    """The prefill job's device and dtype, and how many shards it runs as (``prefill_plan``)."""

    device: Optional[str] = Field("cpu", pattern=r"^[a-z]+(:\d+)?$",
                                  description="cpu, cuda or cuda:N (None: cuda when present).")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Model compute dtype.")
    max_batch_tokens: int = Field(8192, ge=1, description="Padded tokens per forward batch (bounds activation "
                                                          "memory, and how finely the deadline cuts).")
    shards: Union[Literal["auto"], int] = Field(1, description="Shards of the plan, each run as its own flow run of "
                                                               "shard_deployment on the GPU pool (1: run here; "
                                                               "'auto': one per online worker of that pool).")
    shard_deployment: str = Field("prefill-plan/prefill-offpeak", description="The prefill deployment each shard "
                                                                             "runs as, FLOW/DEPLOYMENT.")
    wait_timeout_s: float = Field(600.0, gt=0, description="How long a shard waits for a shared prefix another "
                                                          "shard computes before computing it itself.")

    @field_validator("shards")
    @classmethod
    def _positive_or_auto(cls, shards: Union[str, int]) -> Union[str, int]:
        if shards != "auto" and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1):
            raise BadInputError(f"shards {shards!r} must be a positive whole number or 'auto' (one shard per online "
                                f"worker of the GPU pool)")
        return shards

    @field_validator("shard_deployment")
    @classmethod
    def _a_shard_deployment(cls, name: str) -> str:
        if not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
            raise BadInputError(f"shard_deployment {name!r} must name a deployment as FLOW/DEPLOYMENT, e.g. "
                                f"'prefill-plan/prefill-offpeak'")
        return name


class AuditSpec(_Section):
    """The KV audit after garbage collection (``gc_store``; ``prefill store audit`` by hand): recompute
    sampled snapshots with the target's model, write-back first, and quarantine what differs."""

    budget_gpu_s: float = Field(0.0, ge=0, description="Compute seconds the audit may spend; no forward starts "
                                                       "once they are spent. 0 (the default): no audit.")
    sample: Optional[int] = Field(32, ge=1, description="Snapshots to audit, write-back first, then those of "
                                                        "unknown source, then the prefill job's (None: all).")
    source: Literal["write-back", "prefill", "unknown", "all"] = Field("all", description="Only snapshots of "
                                                                                          "this source.")
    tenant: Optional[str] = Field(None, description="Only this tenant's namespace ('public' for the shared "
                                                    "prefixes; None: every namespace).")
    tolerance_scale: float = Field(1.0, gt=0, lt=1.0 / TOLERANCE.cap,
                                   description=f"Factor on the agreement rule's implementation tolerance "
                                               f"({TOLERANCE.base:g} + {TOLERANCE.per_layer:g} per layer, at most "
                                               f"{TOLERANCE.cap:g}, relative L2 beyond the recorded error).")
    device: Optional[str] = Field("cpu", pattern=r"^[a-z]+(:\d+)?$",
                                  description="cpu, cuda or cuda:N (None: cuda when present).")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Model compute dtype.")
    max_batch_tokens: int = Field(8192, ge=1, description="Tokens per forward chunk (bounds activation memory).")

    @field_validator("tenant")
    @classmethod
    def _a_tenant_name(cls, name: Optional[str]) -> Optional[str]:
        return None if name is None else check_tenant_name(name)


class MonitoringSpec(_Section):
    """The report's economics (``report``; docs/guides/monitoring.md)."""

    gpu_price_per_hour: Optional[float] = Field(None, ge=0, description="Price of one GPU-hour (default: the "
                                                                        "config's monitoring section, else "
                                                                        "$KVWARM_GPU_PRICE_PER_HOUR).")


class StagesSpec(_Section):
    """The pipeline's optional stages."""

    prefill: bool = Field(True, description="Prefill the plan after planning it.")
    gc: bool = Field(True, description="Collect the store's garbage before the report (and audit its KV when "
                                       "audit.budget_gpu_s is above 0).")
    cadence: bool = Field(False, description="Make one short plan (plan_cadence) after the off-peak plan, as the "
                                             "cadence deployment does every cadence.minutes, and publish it as "
                                             "the store's latest.")


class RunSpec(_Section):
    """Every knob of one pipeline run (:func:`flows.pipeline.kvwarm_pipeline`)."""

    target: RunTarget
    mining: MiningSpec
    runner: RunnerSpec = RunnerSpec()
    forecast: ForecastSpec = ForecastSpec()
    plan: PlanSpec = PlanSpec()
    cadence: CadenceSpec = CadenceSpec()
    prefill: PrefillSpec = PrefillSpec()
    audit: AuditSpec = AuditSpec()
    monitoring: MonitoringSpec = MonitoringSpec()
    stages: StagesSpec = StagesSpec()

    @model_validator(mode="after")
    def _one_prefill(self) -> RunSpec:
        if self.plan.schedule_prefill and self.stages.prefill:
            raise BadInputError(f"plan.schedule_prefill ({self.plan.schedule_prefill!r}) schedules the prefill at the "
                             f"window's start and stages.prefill runs it now: set stages.prefill to false to leave "
                             f"it to the deployment, or drop schedule_prefill")
        return self
