# syntax=docker/dockerfile:1
#
# mcpresume container image.
#
#   docker build -t mcpresume .
#   docker run --rm -p 8080:8080 -p 9464:9464 -e MCPRESUME_UPSTREAM=http://mcp-server:8000/mcp mcpresume
#
# Every setting is an MCPRESUME_<NAME> environment variable, a flag after `serve`, or a line of a TOML file
# mounted into the container and named by MCPRESUME_CONFIG (see config/mcpresume.toml).
# Needs BuildKit (the default builder since Docker Engine 23) for the bind mount in the final stage.

# ---- builder: wheels of the dependencies, then of the project --------------------------------------------
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# Dependencies first, from pyproject.toml alone: this layer is rebuilt only when pyproject.toml changes,
# not on every code change. All of them have binary wheels for CPython 3.11 on Linux, so no compiler here.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip wheel --wheel-dir /wheels -r /tmp/requirements.txt

# Then the project itself (README.md is the package's long description; the build only warns without it).
COPY pyproject.toml README.md* ./
COPY mcpresume ./mcpresume
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- final: the wheels installed on a clean slim image, run as a non-root user ---------------------------
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The project's wheel and its runtime dependencies (no extras: the Redis store and the demo are not needed
# to serve). The wheels are bind-mounted, so they take no layer; --no-index: nothing is downloaded here.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels /wheels/mcpresume-*.whl

RUN groupadd --system --gid 10001 mcpresume \
    && useradd --system --uid 10001 --gid mcpresume --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mcpresume

# Listen on all interfaces inside the container (the defaults are loopback-only, right for a bare host).
ENV MCPRESUME_HOST=0.0.0.0 \
    MCPRESUME_METRICS_HOST=0.0.0.0

# 8080: the MCP endpoint (clients, the load balancer). 9464: admin (/metrics, /healthz, /readyz).
EXPOSE 8080 9464

# Numeric user, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001:10001

# slim has no curl: python's urllib, which exits non-zero on a refused connection or a non-2xx status.
# Assumes the admin listener on its default port 9464; adjust if MCPRESUME_METRICS_PORT changes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=3)"]

# mcpresume drains open streams on SIGTERM (up to MCPRESUME_DRAIN_TIMEOUT seconds, 2 s more at worst):
# give `docker stop` a longer timeout than that (-t). It runs as PID 1 and handles SIGTERM itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcpresume"]
CMD ["serve"]
