#
# mcpresume container image.
#
#   docker build -t mcpresume .
#   docker run --rm -p 8080:8080 -p 9464:9464 -e MCPRESUME_UPSTREAM=http://mcp-server:8000/mcp mcpresume
#
# Every setting is an MCPRESUME_<NAME> environment variable, a flag after `serve`, or a line of a TOML file
# mounted into the container and named by MCPRESUME_CONFIG (see config/mcpresume.toml).
#
# Builds with the Dockerfile frontend built into Docker Engine >= 20.10 (BuildKit: DOCKER_BUILDKIT=1, the
# default since Engine 23): there is no `# syntax=` line on purpose, so nothing is fetched from Docker Hub
# but the base image, python:3.11-slim (deploy/image-smoke.sh builds it with a stand-in for that made from
# Debian's archive where the Hub is out of reach). The builder stage downloads the dependencies' wheels
# from PyPI (or the index that PIP_INDEX_URL names, with --build-arg PIP_INDEX_URL=...).
#
# Behind a TLS-intercepting proxy, hand the builder your CA bundle as a BuildKit secret (it is never
# stored in an image layer; absent by default):
#   docker build --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt -t mcpresume .
#
# Stopping: `docker stop` sends SIGTERM and kills after 10 s. mcpresume drains open streams for up to
# MCPRESUME_DRAIN_TIMEOUT seconds and every response is over 2 s later at most, so this image sets the
# drain timeout to 7 s (7 + 2 < 10; the proxy's own default is 10 s). Raising it? Give `docker stop -t`
# (compose: stop_grace_period; Kubernetes: terminationGracePeriodSeconds) more than drain timeout + 2 s,
# or a drain that reaches its deadline is killed (exit 137). The label below says the same.

# ---- builder: wheels of the dependencies, then of the project --------------------------------------------
FROM python:3.11-slim AS builder

ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_INDEX_URL=${PIP_INDEX_URL}

WORKDIR /src

# Dependencies first, from pyproject.toml alone: this layer is rebuilt only when pyproject.toml changes,
# not on every code change. All of them have binary wheels for CPython 3.11 on Linux (--only-binary: no
# compiler here, and no source build that could differ between two builds).
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['redis']))" \
        > /tmp/requirements.txt \
    && pip wheel --only-binary=:all: --wheel-dir /wheels -r /tmp/requirements.txt

# Then the project itself (README.md is the package's long description; the build only warns without it).
COPY pyproject.toml README.md* ./
COPY mcpresume ./mcpresume
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && pip wheel --no-deps --wheel-dir /wheels .

# ---- example-upstream: the bundled example MCP server, for deploy/compose/ (built only when asked for) -----
#   docker build --target example-upstream -t mcpresume-example-upstream .
# The project with its demo extra (the official MCP SDK, uvicorn); not part of the proxy's image.
FROM python:3.11-slim AS example-upstream
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_INDEX_URL=${PIP_INDEX_URL}
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && pip install --only-binary=:all: --find-links=/wheels "$(ls /wheels/mcpresume-*.whl)[demo]"
USER 10001:10001
EXPOSE 8000
# --any-host: the SDK's DNS-rebinding check would refuse the Host of a client that is not on loopback; in
# compose only the proxy reaches this container.
ENTRYPOINT ["python", "-m", "mcpresume.examples.upstream", "--host", "0.0.0.0", "--port", "8000", "--any-host"]

# ---- final: the wheels installed on a clean slim image, run as a non-root user ---------------------------
FROM python:3.11-slim

LABEL org.opencontainers.image.title="mcpresume" \
      org.opencontainers.image.description="Resumable MCP Streamable HTTP streams: a reverse proxy" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.mcpresume.stop-grace="docker stop's grace must exceed MCPRESUME_DRAIN_TIMEOUT (7 s here) + 2 s"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The project's wheel and its runtime dependencies, with the redis extra (the Redis store: several replicas;
# the demo's extra is not needed to serve). The wheels are bind-mounted, so they take no layer; --no-index:
# nothing is downloaded here.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "$(ls /wheels/mcpresume-*.whl)[redis]"

RUN groupadd --system --gid 10001 mcpresume \
    && useradd --system --uid 10001 --gid mcpresume --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mcpresume

# Listen on all interfaces inside the container (the defaults are loopback-only, right for a bare host).
# The ports are the proxy's defaults, set here so the HEALTHCHECK reads the one the container runs with.
# The drain timeout fits `docker stop`'s default grace (see the header).
ENV MCPRESUME_HOST=0.0.0.0 \
    MCPRESUME_METRICS_HOST=0.0.0.0 \
    MCPRESUME_PORT=8080 \
    MCPRESUME_METRICS_PORT=9464 \
    MCPRESUME_DRAIN_TIMEOUT=7

# 8080: the MCP endpoint (clients, the load balancer). 9464: admin (/metrics, /healthz, /readyz).
EXPOSE 8080 9464

# Numeric user, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001:10001

# slim has no curl: python's urllib, which exits non-zero on a refused connection or a non-2xx status.
# It probes the admin port the container is configured with (MCPRESUME_METRICS_PORT; a port set only in
# a config file or by a flag is not seen here: set the variable too). With the admin listener disabled
# (port 0) there is nothing to probe: run with --no-healthcheck.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MCPRESUME_METRICS_PORT', '9464'), timeout=3)"]

# mcpresume runs as PID 1 and handles SIGTERM itself: it drains, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcpresume"]
CMD ["serve"]
