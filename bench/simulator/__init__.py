"""The vLLM simulator (`kvroute-dev sim`): vLLM's HTTP API, metrics and KV events over an engine
without a model."""
