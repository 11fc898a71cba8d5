"""What runs the experiments: child processes and ports, the local stack, fleets of simulated or
real vLLM servers, peer routers, Redis, trace replay and its report, the cache bounds."""
