"""kvwarm's policy in the replay: the pipeline's planner, set up for a trace and a deployment.

The replay's ``kvwarm`` rows are the plans :func:`forecasting.planning.cadence.plan_now`
makes (the call the cadence flow makes), from the trace's requests as log rows, at the
cadence, each from the requests before its time. Here are the settings the replay gives
it: the planner's prices (the deployment's prefill model and stored bytes per token) and
its retain budget, a share of the node tier. The share and the reuse model's defaults
were chosen by ``bench/replay_bench.py --tune`` on tuning points that are never the
evaluation points (docs/guides/simulate.md).
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd

from forecasting.ingest.traces import Trace
from forecasting.planning.cadence import CadenceSpec
from forecasting.planning.planner import PlanCosts
from forecasting.planning.retain import RetainBudget
from forecasting.planning.reuse import ReuseConfig
from forecasting.simulate.policies import Planner
from forecasting.simulate.simulation import Deployment
from store.errors import BadInputError
from store.identity.keys import KeyRoot
from store.plan import Plan

#: the share of the node tier a plan may retain (chosen by ``bench/replay_bench.py --tune``)
RETAIN_FRACTION = 0.25


def retain_spec(deployment: Deployment, *, fraction: float | None = None, reuse: ReuseConfig | None = None,
                lookback_s: float = 3600.0) -> CadenceSpec:
    """The plans' budget: ``fraction`` (default :data:`RETAIN_FRACTION`) of the node tier's bytes.

    Raises:
        BadInputError: ``fraction`` is not in (0, 1].
    """
    share = RETAIN_FRACTION if fraction is None else fraction
    if not 0 < share <= 1:
        raise BadInputError(f"the retain fraction must be in (0, 1], got {share!r}")
    node_bytes = share * deployment.shape.node_blocks * deployment.costs.block_bytes
    return CadenceSpec(RetainBudget(node_bytes=node_bytes), reuse or ReuseConfig(), lookback_s=lookback_s)


def planner_for(trace: Trace, requests: pd.DataFrame, spec: CadenceSpec, deployment: Deployment, *,
                cadence_s: float, roots: Mapping[str, KeyRoot] | None = None, base: Plan | None = None) -> Planner:
    """The planner of the replay's kvwarm rows: ``requests`` (the trace's requests as log rows,
    at the trace's own clock) mined at ``cadence_s``, priced at the deployment's costs."""
    cost = PlanCosts(deployment.costs.prefill, bytes_per_token=deployment.costs.block_bytes / trace.block_tokens)
    return Planner(requests, pd.Timestamp(trace.start_s, unit="s"), cost, spec, cadence_s=cadence_s, roots=roots,
                   base=base)
