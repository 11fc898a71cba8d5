"""The pure routing core: body -> CBR -> block chain -> index -> decision -> request lifecycle.
No I/O, no gRPC, no Kubernetes; imports nothing outside this package."""
