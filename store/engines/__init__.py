"""Adapters from stored KV to the caches serving engines use: contiguous caches for transformers and
paged caches for vLLM (``paged``)."""
