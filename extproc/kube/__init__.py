"""The Kubernetes adapter: follows one KVRoutingPolicy live."""
