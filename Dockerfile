# kvroute's image: `kvroute extproc`, `kvroute controller` (and the other subcommands). The product
# only: the context is what .dockerignore lets through (no bench/, no results, no tests).
# Not built in this repository's CI: the development machines have no container engine.
FROM python:3.11-slim-bookworm
WORKDIR /opt/kvroute
COPY pyproject.toml constraints.txt README.md ./
COPY extproc extproc
COPY controller controller
RUN pip install --no-cache-dir -c constraints.txt . \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin kvroute
USER 65532:65532
ENTRYPOINT ["kvroute"]
