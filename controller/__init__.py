"""The Kubernetes operator for KVRoutingPolicy resources (built under the Kubernetes issue)."""
