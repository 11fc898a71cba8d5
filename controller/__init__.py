"""The KVRoutingPolicy operator (kopf) and the CRD contract it shares with the ext_proc's follower."""
