"""The KV audit as a Prefect task of the maintenance flow (``gc_store``), and its counts as a table artifact.

:func:`audit_task` is a thin wrapper over :func:`prefill.audit.audit` (what ``prefill store
audit`` runs), with the section :class:`flows.spec.AuditSpec` as its knobs: the compute budget
(``budget_gpu_s``: no forward starts once it is spent), the sample, the source, the device.
:func:`publish_audit` publishes the counts by source as a Prefect table artifact under one key
(``kvwarm-audit``), so that each run's table is kept in that key's history; with a named run the
flow also writes them to the run's ``audit.json``, where the report's security-audit family reads them
(docs/guides/monitoring.md).
"""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.spec import AuditSpec
from flows.tasks import IO_RETRIES, IO_RETRY_DELAY_S, check_remote_tiers, s3_reachable, transient
from store.config import KvwarmConfig

#: the artifact key every audit's table is published under
ARTIFACT_KEY = "kvwarm-audit"


def audit_options(spec: AuditSpec) -> Any:
    """The :class:`prefill.audit.AuditOptions` of a flow's audit section."""
    from prefill.agreement import TOLERANCE
    from prefill.audit import AuditOptions
    from prefill.audit_catalogue import SOURCE_ORDER

    return AuditOptions(sample=spec.sample, sources=SOURCE_ORDER if spec.source == "all" else (spec.source,),
                        namespace=spec.tenant, tolerance=TOLERANCE.scaled(spec.tolerance_scale),
                        budget_s=spec.budget_gpu_s, max_batch_tokens=spec.max_batch_tokens, quarantine=True)


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def audit_task(store_url: str, loaded: Any, config: KvwarmConfig, spec: AuditSpec) -> dict[str, Any]:
    """Audit the store's KV against ``loaded`` within ``spec.budget_gpu_s`` compute seconds
    (``prefill.audit.audit``); returns ``AuditReport.as_dict()``. Copies that differ are quarantined."""
    from prefill.audit import audit
    from store.cli import configured_tenants
    from store.tiers.store import Store

    store = Store.open(store_url, config)
    try:
        with s3_reachable(config, "audit"):
            check_remote_tiers(store)
            report = audit(loaded, store, audit_options(spec), tenants=configured_tenants(config))
    finally:
        store.close()
    result = report.as_dict()
    log = get_run_logger()
    if report.clean:
        log.info("audit: %d cop(ies) checked, all agree with the model (%.1f s of compute%s)", result["checked"],
                 report.compute_s, "; budget spent" if report.stopped else "")
    else:
        log.error("audit: %d of %d cop(ies) differ from the model's KV and were quarantined: %s",
                  result["differed"], result["checked"], "; ".join(f"{w}: {r}" for w, r in report.differences[:5]))
    return result


def audit_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{source, checked, agreed, differed, quarantined}`` of an audit's result, then the total."""
    rows = [{"source": s, **{k: c[k] for k in ("checked", "agreed", "differed", "quarantined")}}
            for s, c in result["by_source"].items()]
    return rows + [{"source": "all", **{k: result[k] for k in ("checked", "agreed", "differed", "quarantined")}}]


def publish_audit(result: dict[str, Any]) -> Any:
    """Publish an audit's counts as a Prefect table artifact (key :data:`ARTIFACT_KEY`); returns its id."""
    from prefect.artifacts import create_table_artifact

    stopped = "; stopped: the compute budget is spent" if result.get("stopped") == "budget" else ""
    return create_table_artifact(table=audit_table(result), key=ARTIFACT_KEY,
                                 description=f"kvwarm KV audit: {result['compute_s']} s of compute, "
                                             f"{result['forwards']} forward(s){stopped}")
