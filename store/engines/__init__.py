"""Adapters from stored KV to the caches serving engines use: contiguous caches for transformers and
paged caches (``paged``), and kvwarm inside vLLM as a KV connector (``vllm``: ``KvwarmConnector``)."""
