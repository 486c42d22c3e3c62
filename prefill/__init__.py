"""Prefill: the job that turns a plan into FP8 KV snapshots, and the ``prefill`` CLI (``prefill.cli:main``).

Public face: ``prefill.models`` (``load_model``, ``LoadedModel``, the built-ins
``kvwarm-tiny`` and ``kvwarm-ref``), ``prefill.runner`` (``Prefiller``, ``PrefillOptions``,
``PrefixRequest``, ``PrefillReport``), ``prefill.warm`` (``warm``: what the flows call),
``bench.lib.precision_loss`` (``precision_loss``), ``prefill.schedule`` (the radix segments).
"""
