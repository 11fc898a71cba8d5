"""Benchmarks: measured costs of the routing core and, later, of the whole stack."""
