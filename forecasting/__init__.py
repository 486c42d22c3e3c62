"""Mining request logs, forecasting prefix demand, planning prewarms, and replaying traces.

Public face (import from the modules; nothing is imported here):

- ``forecasting.logs``: ``read_logs`` (JSONL/Parquet, local or s3://, with quarantine)
- ``forecasting.mining``: ``mine_text``, ``mine_hash_log``, ``mine_trace``, ``candidates``
- ``forecasting.families``: ``find_families``, ``adapt_threshold`` (MinHash LSH)
- ``forecasting.demand``: ``Demand``, ``build_demand`` (the long demand table)
- ``forecasting.traces``: ``read_mooncake``, ``read_kvwarm``, ``Trace``
- ``forecasting.replay`` / ``forecasting.simulate``: the what-if replay behind ``prefill simulate``
"""
