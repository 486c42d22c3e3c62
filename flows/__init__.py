"""Prefect flows that run kvwarm: mine -> forecast -> plan -> prefill -> GC -> report (docs/guides/pipeline.md).

- ``flows.pipeline``: the stage flows and the parent ``kvwarm_pipeline``
- ``flows.tasks``: thin tasks over the packages, the run directory under the store
- ``flows.report``: report JSON/markdown and the PNG plots
- ``bench.lib.sample_logs``: the deterministic sample request logs (``flows/data``)
- ``flows.demo``: ``python -m flows.demo --store file:///DIR``

``store``, ``prefill`` and ``forecasting`` never import this package.
"""
