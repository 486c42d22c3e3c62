"""What-if replay (``prefill simulate``): prefix caches replayed over a trace (``replay``), prewarm
choices (``prewarm``), scenarios and policies (``simulation``), the TTFT cost model (``ttft``) and the CLI (``cli``)."""
