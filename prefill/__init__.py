"""Prefill: the job that turns a plan into FP8 KV snapshots, and the ``prefill`` CLI (``prefill.cli:main``)."""
