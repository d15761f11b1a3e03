#!/usr/bin/env bash
# Build the container image from the Dockerfile and run it, as a user would: the CI step for the image.
#
#   sudo bash deploy/image-smoke.sh          (root: it starts its own dockerd; .ci/run runs it)
#
# 1. Installs Debian's docker.io and debootstrap if missing (no service is started by the install).
# 2. Starts a private dockerd (its own data root, socket and pid file in a temporary directory) with no
#    bridge and no iptables rules: builds and runs use --network=host, so traffic stays on loopback.
# 3. The base image: python:3.11-slim is pulled where Docker Hub is reachable; otherwise a stand-in is made
#    from Debian's archive (debootstrap --variant=minbase bookworm + Debian's python3 and pip, laid out as
#    the official image is: python and pip on PATH, pip free to install) and tagged python:3.11-slim.
# 4. Builds the image with Debian's docker client (BuildKit built in), the host's CA bundle handed to the
#    builder as the pip-ca secret (see the Dockerfile's header).
# 5. Runs it (read-only root, no capabilities, as the Kubernetes manifest does) in front of the bundled
#    example upstream and checks: /healthz, /readyz, /metrics; the official MCP SDK client calls a tool
#    through it; the process is PID 1 with uid 10001; the image's HEALTHCHECK (on MCPRESUME_METRICS_PORT,
#    set to a free port here) turns the container healthy; `demo` without the demo extra says how to get
#    it; `docker stop`, with a stream open that the drain has to end at its deadline, exits 0 within its
#    default 10 s grace.
# Stops everything it started, by pid, and removes its directory. Exits non-zero on any failure.
#
# Environment: PYTHON (default .venv/bin/python: needs the project with its test or demo extra),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), PIP_CA (default /etc/ssl/certs/ca-certificates.crt).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
PYTHON=${PYTHON:-$root/.venv/bin/python}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PIP_CA=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
DOCKER=/usr/bin/docker  # Debian's client, whatever else is on PATH
BASE=python:3.11-slim
IMAGE=mcpresume:smoke
GRACE=10  # docker stop's default

start=$SECONDS
say() { echo "image-smoke: $* (+$((SECONDS - start)) s)"; }
die() { echo "image-smoke: FAIL: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it starts its own dockerd)"
[ -x "$PYTHON" ] || die "no Python at $PYTHON (set PYTHON, or make .venv with the test extra)"
"$PYTHON" -c 'import mcp, mcpresume' || die "$PYTHON lacks the MCP SDK: pip install -e '.[test]'"

# -- 1. the tools ------------------------------------------------------------------------------------------
if [ ! -x "$DOCKER" ] || ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    say "apt-get install docker.io debootstrap"
    # No service may start on install (a system dockerd would add a bridge and iptables rules).
    policy=/usr/sbin/policy-rc.d
    made_policy=
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io debootstrap \
        >/dev/null || { [ -n "$made_policy" ] && rm -f "$policy"; die "apt-get install docker.io debootstrap"; }
    [ -n "$made_policy" ] && rm -f "$policy"
fi

work=$(mktemp -d /var/tmp/mcpresume-smoke.XXXXXX)
export DOCKER_HOST="unix://$work/docker.sock"
container="mcpresume-smoke-$$"
dockerd_pid='' upstream_pid='' hold_pid=''

cleanup() {
    local rc=$?
    set +e
    if [ "$rc" != 0 ]; then
        echo "image-smoke: --- container log ---" >&2
        "$DOCKER" logs "$container" 2>&1 | tail -n 40 >&2
        echo "image-smoke: --- dockerd log (tail) ---" >&2
        tail -n 20 "$work/dockerd.log" >&2
    fi
    for pid in $hold_pid $upstream_pid; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    if [ -n "$dockerd_pid" ]; then
        "$DOCKER" rm -f "$container" >/dev/null 2>&1
        kill "$dockerd_pid" 2>/dev/null
        for _ in $(seq 150); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$dockerd_pid" 2>/dev/null
        wait "$dockerd_pid" 2>/dev/null
    fi
    # Whatever dockerd left mounted under its directory (it unmounts its own on a clean exit).
    awk -v dir="$work/" 'index($2, dir) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf "$work"
    echo "image-smoke: finished with exit code $rc after $((SECONDS - start)) s"
    exit "$rc"
}
trap cleanup EXIT

# -- 2. a private dockerd -------------------------------------------------------------------------------
say "dockerd (--bridge=none --iptables=false, data in $work)"
dockerd --data-root "$work/docker" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
    --host "$DOCKER_HOST" --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
    >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 300); do
    "$DOCKER" version >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || die "dockerd exited: $(tail -n 5 "$work/dockerd.log")"
    sleep 0.1
done
"$DOCKER" version >/dev/null 2>&1 || die "dockerd did not answer within 30 s"
say "dockerd $("$DOCKER" version -f '{{.Server.Version}}'), storage driver $("$DOCKER" info -f '{{.Driver}}')"

# -- 3. the base image ----------------------------------------------------------------------------------
if timeout 30 "$DOCKER" pull -q "$BASE" >/dev/null 2>&1; then
    say "base image $BASE pulled"
else
    say "$BASE cannot be pulled: a stand-in from Debian's archive (debootstrap minbase bookworm + python3)"
    rootfs="$work/rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip bookworm "$rootfs" "$DEBIAN_MIRROR" \
        >"$work/debootstrap.log" 2>&1 || die "debootstrap: $(tail -n 5 "$work/debootstrap.log")"
    # As the official image: `python` and `pip` on PATH, and pip may install into the system Python.
    ln -s /usr/bin/python3 "$rootfs/usr/local/bin/python"
    ln -s /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    say "stand-in $BASE: $("$DOCKER" run --rm --network=none "$BASE" python --version 2>&1)"
fi

# -- 4. the build ---------------------------------------------------------------------------------------
secret=()
[ -s "$PIP_CA" ] && secret=(--secret "id=pip-ca,src=$PIP_CA")
say "docker build ${secret[*]} -t $IMAGE ."
DOCKER_BUILDKIT=1 "$DOCKER" build --network=host "${secret[@]}" -t "$IMAGE" "$root" >"$work/build.log" 2>&1 \
    || die "docker build: $(tail -n 30 "$work/build.log")"
say "built $IMAGE ($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'))"

# -- 5. run it ------------------------------------------------------------------------------------------
"$PYTHON" "$here/image_smoke.py" upstream "$work/upstream.url" &
upstream_pid=$!
for _ in $(seq 300); do [ -s "$work/upstream.url" ] && break; sleep 0.1; done
[ -s "$work/upstream.url" ] || die "the example upstream did not start"
upstream_url=$(cat "$work/upstream.url")
read -r port admin < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

say "docker run: proxy on 127.0.0.1:$port, admin on 127.0.0.1:$admin, upstream $upstream_url"
# --health-interval: the image's own probe, run every second instead of every 30 s, to see it pass soon.
"$DOCKER" run -d --name "$container" --network=host --read-only --cap-drop=ALL \
    --security-opt no-new-privileges --health-interval=1s \
    -e MCPRESUME_UPSTREAM="$upstream_url" -e MCPRESUME_HOST=127.0.0.1 -e MCPRESUME_METRICS_HOST=127.0.0.1 \
    -e MCPRESUME_PORT="$port" -e MCPRESUME_METRICS_PORT="$admin" "$IMAGE" >/dev/null

health=
for _ in $(seq 300); do
    health=$("$DOCKER" inspect -f '{{.State.Status}} {{.State.Health.Status}}' "$container")
    case $health in
        "running healthy") break ;;
        running*) sleep 0.1 ;;
        *) die "the container is $health" ;;
    esac
done
[ "$health" = "running healthy" ] || die "the container is not healthy within 30 s: $health"
say "HEALTHCHECK on MCPRESUME_METRICS_PORT=$admin: healthy"

"$PYTHON" "$here/image_smoke.py" check "http://127.0.0.1:$port/mcp" "http://127.0.0.1:$admin"

uid=$("$DOCKER" exec "$container" grep '^Uid:' /proc/1/status | awk '{print $2}')
cmdline=$("$DOCKER" exec "$container" cat /proc/1/cmdline | tr '\0' ' ')
[ "$uid" = 10001 ] || die "PID 1 runs as uid $uid, not 10001"
case $cmdline in
    *mcpresume\ serve*) ;;
    *) die "PID 1 is not mcpresume serve: $cmdline" ;;
esac
say "PID 1 is '$cmdline' with uid $uid"

set +e
demo_err=$("$DOCKER" run --rm --network=none "$IMAGE" demo --once 2>&1 >/dev/null)
demo_rc=$?
set -e
[ "$demo_rc" = 2 ] && [ "$(printf '%s\n' "$demo_err" | wc -l)" = 1 ] \
    && [[ $demo_err == *"pip install 'mcpresume[demo]'"* ]] \
    || die "demo without the demo extra: exit $demo_rc, $demo_err"
say "demo without the extra: exit 2, '$demo_err'"

# The Redis store's client is in the image (several replicas need no image of their own).
"$DOCKER" run --rm --network=none --entrypoint python "$IMAGE" -c 'import redis.asyncio, hiredis' \
    || die "the image lacks the redis extra (redis-py, hiredis)"
say "the redis extra is installed"

# A stream the drain cannot finish (a tool call far longer than the drain timeout): it is ended at the
# deadline, cleanly, and the container still exits 0 within docker stop's grace.
"$PYTHON" "$here/image_smoke.py" hold "http://127.0.0.1:$port/mcp" "$work/held" &
hold_pid=$!
for _ in $(seq 300); do [ -s "$work/held" ] && break; sleep 0.1; done
[ -s "$work/held" ] || die "the held stream did not start"
drain=$("$DOCKER" inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$container" \
    | sed -n 's/^MCPRESUME_DRAIN_TIMEOUT=//p')
stop_start=$SECONDS
"$DOCKER" stop "$container" >/dev/null
elapsed=$((SECONDS - stop_start))
exit_code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$container")
[ "$exit_code" = 0 ] || die "docker stop: the container exited $exit_code (137: killed after the grace)"
[ "$elapsed" -lt "$GRACE" ] || die "docker stop took $elapsed s, not under its $GRACE s grace"
wait "$hold_pid" || { hold_pid=; die "the held stream did not end cleanly"; }
hold_pid=
say "docker stop: exit code 0 after $elapsed s (drain_timeout $drain s, grace $GRACE s)"
say "OK"
