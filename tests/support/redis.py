"""Real Redis processes for the tests: a throwaway ``redis-server`` on a free loopback port in a temp dir
(no persistence), and a real 3-node Redis Cluster (``--cluster-enabled yes`` x3 + ``redis-cli --cluster
create``). The fixtures (tests/conftest.py) skip with a visible reason only when the binaries are missing,
and fail under CI (env ``CI`` set)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from mcpresume.store.redis import RedisStore
from tests.support import redis_ping

START_TIMEOUT = 15.0

MakeRedisStore = Callable[..., Awaitable[RedisStore]]
"""The ``redis_stores`` fixture (tests/conftest.py): ``make(url, limits, **options)`` -> a started store."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def binary(name: str) -> str:
    """The path of ``name`` (redis-server, redis-cli), or a skip (a failure under CI) when it is missing."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} not found on PATH (Debian: apt-get install redis-server redis-tools)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the Redis tests", pytrace=False)
        pytest.skip(message)
    return found


def _wait_until(condition: object, what: str, timeout: float = START_TIMEOUT) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)  # a subprocess's readiness can only be polled


class RedisProcess:
    """One ``redis-server``: start, stop (kill), pause (SIGSTOP), resume (SIGCONT), restart on its port."""

    def __init__(self, workdir: Path, *extra: str, cluster: bool = False) -> None:
        self.binary = binary("redis-server")
        self.workdir = workdir
        self.extra = extra
        # A cluster node's bus port defaults to port + 10000, which a free port near the top of the range
        # overflows (or another process holds): a free port of its own instead.
        self.cluster = cluster
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def _spawn(self) -> bool:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir), "--logfile", str(self.log), "--daemonize", "no", *self.extra]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
            args += ["--cluster-config-file", str(self.workdir / "nodes.conf")]
        proc = self.proc = subprocess.Popen(
            [self.binary, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None and not redis_ping(self.port):
            time.sleep(0.02)  # a subprocess's readiness can only be polled
        if proc.poll() is None and redis_ping(self.port):
            return True
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        return False

    def start(self) -> RedisProcess:
        for _attempt in range(3):  # the free port can be taken between probing and binding
            self.port = free_port()
            if self._spawn():
                return self
        detail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else "no log"
        pytest.fail(f"redis-server did not start:\n{detail}", pytrace=False)

    def restart(self) -> None:
        """Start again on the same port (after ``stop``): an empty Redis."""
        for _attempt in range(50):  # the port may linger a moment after the kill
            if self._spawn():
                return
            time.sleep(0.1)
        raise AssertionError(f"redis-server did not restart on port {self.port}")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused one must be able to die
        proc.kill()
        proc.wait()
        self.proc = None


class RedisClusterProcesses:
    """Three ``redis-server --cluster-enabled yes`` joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[RedisProcess] = []

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterProcesses:
        cli = binary("redis-cli")
        for index in range(3):
            node_dir = self.workdir / f"node{index}"
            node_dir.mkdir()
            node = RedisProcess(node_dir, cluster=True)
            self.nodes.append(node.start())
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=60,
        )

        def settled() -> bool:
            for node in self.nodes:
                info = subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"],
                    capture_output=True,
                    timeout=10,
                    check=False,
                ).stdout
                if b"cluster_state:ok" not in info or b"cluster_slots_assigned:16384" not in info:
                    return False
            return True

        _wait_until(settled, "the cluster to reach cluster_state:ok on every node", timeout=60)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
