"""Header names shared by the ext_proc servicer and the Envoy bootstrap it is deployed with."""

# The endpoint-picker protocol's destination header: kvroute sets it, Envoy's override_host
# policy follows it, and any client-supplied copy is stripped before ext_proc sees the request.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
