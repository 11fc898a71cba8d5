"""The HTTP adapter: monitoring (/metrics, /healthz, /readyz), state and the query/lease API."""
