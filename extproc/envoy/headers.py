"""Header names shared by the ext_proc servicer and the Envoy bootstrap it is deployed with."""

# The endpoint-picker protocol's destination header: kvroute sets it, Envoy's override_host
# policy follows it, and any client-supplied copy is stripped before ext_proc sees the request.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The same protocol's dynamic metadata: the destination goes out under this namespace and the
# DESTINATION_HEADER key too; gateways report the endpoint that served under SERVED_KEY.
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# A gateway may restrict the choice to a subset: metadata namespace SUBSET_NAMESPACE, key SUBSET_KEY.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Set on a request while kvroute has it and not yet decided (buffered bodies): if the ext_proc dies
# or times out meanwhile, a fail-open Envoy would send it on unrouted, past the queue; kvroute's
# bootstrap answers a request still carrying it with a 503 instead. The decision removes it.
PENDING_HEADER = "x-kvroute-pending"
# The ext_authz transport (authz.py): names the exchange a request's access-log entry ends. kvroute
# sets it on the upstream request; a client-supplied copy is stripped like the destination's.
EXCHANGE_HEADER = "x-kvroute-exchange"
# Its check requests' path: this prefix, then the request's own path (Envoy's path_prefix).
ROUTE_PREFIX = "/kvroute/route"
# The requests kvroute is asked about (POST): every path on which vLLM's server generates text. The
# first three carry chat or completions bodies, routed by their prompt (`/invocations` is the
# SageMaker route, which vLLM always serves, to the same handlers); the others' bodies kvroute does
# not read as prompts: they go least loaded, and where an engine may act on transfer parameters
# they are refused (processor._refuses_unread). Any other path or method is not read. Until
# 2026-12-07 only the first two were asked, and the rest went round robin, unseen by flow control,
# load and the transfer-parameter rule.
LLM_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/invocations",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
)
