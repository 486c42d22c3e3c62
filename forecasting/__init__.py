"""Mining request logs, forecasting prefix demand, planning prewarms, and replaying traces.

Public face (import from the modules; nothing is imported here):

- ``forecasting.logs``: ``read_logs`` (JSONL/Parquet, local or s3://, with quarantine)
- ``forecasting.mining``: ``mine_text``, ``mine_hash_log``, ``mine_trace``, ``candidates``
- ``forecasting.families``: ``find_families``, ``adapt_threshold`` (MinHash LSH)
- ``forecasting.demand``: ``Demand``, ``build_demand`` (the long demand table)
- ``forecasting.servegen``: ``load_servegen`` (per-client rates -> hourly counts)
- ``forecasting.backtest`` / ``forecasting.parallel``: ``forecast_frame``, ``forecast_frame_parallel``
  (per-series model choice by rolling-origin MASE); ``forecasting.models``: the candidates
- ``forecasting.hierarchy``: top-down splits of family totals to prefixes
- ``forecasting.offpeak``: ``offpeak_windows``, ``pick_window``
- ``forecasting.planner``: ``make_plan`` (-> ``store.plan.Plan``); ``forecasting.accuracy``: ``warmup_accuracy``
- ``forecasting.traces``: ``read_mooncake``, ``read_kvwarm``, ``Trace``
- ``forecasting.replay`` / ``forecasting.simulate``: the what-if replay behind ``prefill simulate``
"""
