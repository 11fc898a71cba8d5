"""Process pieces the adapters share: configuration layers, the backend pool and its probes, metrics."""
