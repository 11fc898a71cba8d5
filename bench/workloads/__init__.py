"""Workloads: traces (Mooncake JSONL, ready bodies), the prompts built from them, synthesized
skewed and agentic traces, other clients' traffic."""
