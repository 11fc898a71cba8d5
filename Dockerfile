# kvroute's images, built from the context .dockerignore lets through (no results, no tests).
#   product (the default, last stage): `kvroute extproc`, `kvroute controller` and the other
#     subcommands; the product only.
#   simulator (`--target simulator`): the vLLM simulator the tests and demos run as backends.
# BASE is any Debian-based image with Python 3.11 and pip; tests/node_images.py builds one from
# Debian packages, as the test node reaches no registry.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS runtime
WORKDIR /opt/kvroute
COPY pyproject.toml constraints.txt README.md ./
COPY extproc extproc
COPY controller controller
RUN pip install --no-cache-dir -c constraints.txt . \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin kvroute
USER 65532:65532

FROM runtime AS simulator
COPY bench/__init__.py bench/__init__.py
COPY bench/simulator bench/simulator
ENTRYPOINT ["python", "-m", "bench.simulator.sim"]

FROM runtime AS product
ENTRYPOINT ["kvroute"]
