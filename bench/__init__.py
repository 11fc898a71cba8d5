"""kvroute's developer tools (`kvroute-dev`): the vLLM simulator, the local stack, trace replay,
peer routers and benchmarks. They use the product; the product never imports them, nor ships them."""
