"""Mining request logs, forecasting prefix demand, planning prewarms, and replaying traces.

Public face (import from the modules; nothing is imported here):

- ``forecasting.ingest.logs``: ``read_logs`` (JSONL/Parquet, local or s3://, with quarantine)
- ``forecasting.mining.prefix_tree``: ``mine_text``, ``mine_hash_log``, ``mine_trace``, ``candidates``
- ``forecasting.mining.families``: ``find_families``, ``adapt_threshold`` (MinHash LSH)
- ``forecasting.mining.demand``: ``Demand``, ``build_demand`` (the long demand table)
- ``bench.lib.servegen``: ``load_servegen`` (per-client rates -> hourly counts)
- ``forecasting.models.selection`` / ``forecasting.models.parallel``: ``forecast_frame``, ``forecast_frame_parallel``
  (per-series model choice by rolling-origin MASE); ``forecasting.models.catalog``: the candidates
- ``bench.lib.hierarchy``: top-down splits of family totals to prefixes
- ``forecasting.planning.offpeak``: ``offpeak_windows``, ``pick_window``
- ``forecasting.planning.planner``: ``make_plan`` (-> ``store.plan.Plan``); ``forecasting.planning.accuracy``: ``warmup_accuracy``
- ``forecasting.ingest.traces``: ``read_mooncake``, ``read_kvwarm``, ``Trace``
- ``forecasting.simulate.replay`` / ``forecasting.simulate.simulation``: the what-if replay behind ``prefill simulate``
"""
