"""kvroute's ext_proc, in layers that import only downwards (tests/test_layers.py checks it):
core (pure routing) <- runtime (config, pool, metrics) <- adapters (envoy, admin, kube) <- service <- cli."""
