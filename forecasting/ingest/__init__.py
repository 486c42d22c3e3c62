"""Reading what the pipeline learns from: request logs (``logs``, rows checked by ``log_row``),
request traces as block chains (``traces``: Mooncake and kvwarm's own), and logs as a replay trace (``log_trace``)."""
