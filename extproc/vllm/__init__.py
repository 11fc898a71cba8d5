"""Adapters for what vLLM engines publish: /metrics samples, KV cache events, the tokenizer."""
