"""The benchmarks and experiments (`kvroute-dev bench ...`), one module each."""
