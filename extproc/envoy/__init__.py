"""The Envoy adapter: the ext_proc servicer (protobuf <-> the core's request lifecycle), the
Envoy bootstrap generator and the generated protocol classes."""
