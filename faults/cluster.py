"""The processes of one layout, all real and on 127.0.0.1: one ``redis-server`` (AOF on, its data in the run's
directory, so a restart keeps it), three proxies (``python -m mcpresume serve``: one replica id and one port
each, for life), their upstream(s) (`faults.upstream`), and the balancer in front (`faults.balancer`).

``sidecar``: each pod is a proxy and an upstream of its own (no event store): a session lives in the pod
that answered its ``initialize``. ``shared``: the three proxies front one upstream that keeps an event
store, so a stream broken at one proxy resumes at the upstream from another.

Every child runs in a session of its own and dies with the campaign (``PR_SET_PDEATHSIG``); every change of
a process's state (started, killed, stopped, continued, exited by itself, failed to start) is recorded in the
nemesis log with its pid, which is how the checker knows who was alive. A process that exits without the
nemesis's signal is started again after a second, as an orchestrator would (and recorded as such).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from faults.balancer import Balancer
from faults.history import JsonLines
from faults.plan import PODS

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
READY_TIMEOUT = 30.0
RESTART_DELAY = 1.0  # how long an orchestrator waits before starting a process that exited on its own
START_GIVE_UP = 120.0  # a process that has not served after this many seconds of attempts ends the run
_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# Ports below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default): a pod's port,
# free while the pod is down, must not become the source port of some connection (the clients open one per
# request), nor another process's ``bind(0)``, or the pod could not start again on it.
PORTS = range(20_000, 32_000)


_GIVEN: set[int] = set()  # two layouts run side by side in one process: never the same port twice


def free_port() -> int:
    for _ in range(1000):
        port = random.choice(PORTS)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind((LOOPBACK, port))
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError(f"no free port in {PORTS}")


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``127.0.0.1:port`` (/proc: the LISTEN socket's inode among
    its descriptors), not another process that took the port meanwhile."""
    local = f"0100007F:{port:04X}"
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    return False


async def redis_command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command to redis-server (RESP), its simple or bulk reply as text; an error reply raises."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), timeout)
    try:
        request = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        writer.write(request.encode())
        line = (await asyncio.wait_for(reader.readline(), timeout)).decode().rstrip("\r\n")
        if line.startswith("-"):
            raise RuntimeError(f"redis: {line[1:]}")
        if line.startswith("$"):
            size = int(line[1:])
            if size < 0:
                return ""
            body = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            return body[:-2].decode()
        return line[1:]
    finally:
        writer.transport.abort()


@dataclass
class Proc:
    """One child process, started again under the same name, port and arguments."""

    name: str
    argv: list[str]
    port: int
    log_dir: Path
    popen: subprocess.Popen[bytes] | None = None
    expected: bool = False  # should be running: an exit is the process's own, not the nemesis's
    ready: bool = False
    incarnation: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def spawn(self) -> None:
        log = self.log_dir / f"{self.name}.{self.incarnation}.log"
        self.incarnation += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **self.env}
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=str(ROOT),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup,
            )
        self.ready = False

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def reap(self) -> int | None:
        if self.popen is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.popen.wait(5)
        return None


class Cluster:
    def __init__(self, layout: str, run_dir: Path, lease: float, log: JsonLines) -> None:
        self.layout, self.run_dir, self.lease, self.log = layout, run_dir, lease, log
        self.procs: dict[str, Proc] = {}
        self.redis_port = free_port()
        redis_dir = run_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found on PATH (Debian: apt-get install redis-server)")
        self.redis = self._proc(
            "redis",
            [
                *(binary, "--port", str(self.redis_port), "--bind", LOOPBACK, "--dir", str(redis_dir)),
                *("--appendonly", "yes", "--appendfsync", "everysec", "--save", ""),
                *("--maxmemory-policy", "noeviction", "--daemonize", "no"),
            ],
            self.redis_port,
        )
        store = f"redis://{LOOPBACK}:{self.redis_port}/0"
        self.upstreams: dict[str, Proc] = {}
        names = [f"upstream-{pod}" for pod in PODS] if layout == "sidecar" else ["upstream"]
        for name in names:
            port = free_port()
            argv = [sys.executable, "-m", "faults.upstream", "--name", name, "--port", str(port)]
            argv += ["--log", str(run_dir / f"{name}.jsonl")]
            if layout == "shared":
                argv.append("--event-store")
            self.upstreams[name] = self._proc(name, argv, port)
        self.proxies: dict[str, Proc] = {}
        for pod in PODS:
            upstream = self.upstreams[f"upstream-{pod}" if layout == "sidecar" else "upstream"]
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "mcpresume",
                "serve",
                "--upstream",
                f"http://{LOOPBACK}:{upstream.port}/mcp",
            ]
            argv += ["--host", LOOPBACK, "--port", str(port), "--metrics-port", "0", "--store", store]
            argv += ["--advertise-url", f"http://{LOOPBACK}:{port}/mcp", "--replica-id", f"pod-{pod}"]
            argv += ["--owner-lease-ttl", str(lease), "--log-level", "info"]
            self.proxies[pod] = self._proc(f"proxy-{pod}", argv, port)
        self.balancer = Balancer([p.port for p in self.proxies.values()])
        self._supervisor: asyncio.Task[None] | None = None
        self._restarting: dict[str, asyncio.Task[None]] = {}
        self.closing = False

    def _proc(self, name: str, argv: list[str], port: int) -> Proc:
        proc = Proc(name, argv, port, self.run_dir / "logs")
        proc.log_dir.mkdir(exist_ok=True)
        self.procs[name] = proc
        return proc

    def record(self, proc: Proc, state: str, **fields: object) -> None:
        self.log.write("proc", name=proc.name, pid=proc.pid, state=state, **fields)

    # -- start, stop, supervise ---------------------------------------------------------------------------

    async def _ready(self, proc: Proc) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not proc.alive():
                return False
            if listens(proc.pid, proc.port):
                if proc is not self.redis:
                    return True
                with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                    if await redis_command(proc.port, "PING") == "PONG":  # its AOF loaded
                        return True
            await asyncio.sleep(0.05)
        return False

    async def start_proc(self, proc: Proc) -> None:
        """Start ``proc`` and wait until it serves; one that exits first is recorded and started again
        after a second (as an orchestrator would), until it serves or the campaign closes."""
        proc.expected = True
        give_up = time.monotonic() + START_GIVE_UP
        while not self.closing:
            if time.monotonic() > give_up:
                raise RuntimeError(f"{proc.name} did not start in {START_GIVE_UP:.0f} s: see {proc.log_dir}")
            proc.spawn()
            if await self._ready(proc):
                proc.ready = True
                self.record(proc, "started")
                return
            if proc.alive():
                proc.signal(signal.SIGKILL)
            self.record(proc, "failed_start", code=proc.reap())
            await asyncio.sleep(RESTART_DELAY)

    async def start(self) -> None:
        await self.start_proc(self.redis)
        await asyncio.gather(*(self.start_proc(u) for u in self.upstreams.values()))
        await asyncio.gather(*(self.start_proc(p) for p in self.proxies.values()))
        await self.balancer.start()
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self.closing:
            await asyncio.sleep(0.25)
            for proc in list(self.procs.values()):
                if proc.expected and proc.ready and not proc.alive() and proc.name not in self._restarting:
                    self.record(proc, "exited", code=proc.reap())
                    self._restarting[proc.name] = asyncio.create_task(self._restart_later(proc))

    async def _restart_later(self, proc: Proc) -> None:
        try:
            await asyncio.sleep(RESTART_DELAY)
            if proc.expected and not proc.alive():
                await self.start_proc(proc)
        finally:
            self._restarting.pop(proc.name, None)

    async def close(self) -> None:
        self.closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        for task in list(self._restarting.values()):
            task.cancel()
        await self.balancer.close()
        for proc in self.procs.values():
            proc.expected = False
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        for proc in self.procs.values():
            if proc.popen is not None and proc.reap() is None:
                proc.signal(signal.SIGKILL)
                proc.reap()

    # -- what the nemesis does ----------------------------------------------------------------------------

    def kill(self, proc: Proc) -> None:
        proc.expected = False
        self.record(proc, "killed")
        proc.signal(signal.SIGKILL)
        proc.reap()

    def pod_procs(self, pod: str) -> list[Proc]:
        procs = [self.proxies[pod]]
        if self.layout == "sidecar":
            procs.insert(0, self.upstreams[f"upstream-{pod}"])
        return procs

    def kill_pod(self, pod: str) -> None:
        for proc in self.pod_procs(pod):
            self.kill(proc)

    async def start_pod(self, pod: str) -> None:
        for proc in self.pod_procs(pod):  # the upstream first: the proxy is its sidecar
            await self.start_proc(proc)

    def pause(self, proc: Proc) -> None:
        self.record(proc, "stopped")
        proc.signal(signal.SIGSTOP)

    def resume(self, proc: Proc) -> None:
        proc.signal(signal.SIGCONT)
        self.record(proc, "continued")

    async def stop_redis(self) -> None:
        """SIGTERM: redis-server syncs its AOF and exits (a restart keeps every write)."""
        proc = self.redis
        proc.expected = False
        self.record(proc, "killed", signal="SIGTERM")
        proc.signal(signal.SIGTERM)
        await asyncio.to_thread(proc.reap)

    async def fill_redis(self) -> int:
        """``maxmemory`` down to the memory in use (``noeviction``): every write that needs memory fails."""
        info = await redis_command(self.redis_port, "INFO", "memory")
        used = next(int(line.split(":")[1]) for line in info.splitlines() if line.startswith("used_memory:"))
        await redis_command(self.redis_port, "CONFIG", "SET", "maxmemory", str(used))
        return used

    async def unfill_redis(self) -> None:
        await redis_command(self.redis_port, "CONFIG", "SET", "maxmemory", "0")

    def upstream_of(self, target: str) -> Proc:
        return self.upstreams["upstream" if target == "shared" else f"upstream-{target}"]

    async def heal(self) -> None:
        """Everything running and answering again, whatever a fault left."""
        for proc in self.procs.values():
            proc.signal(signal.SIGCONT)
        for proc in [self.redis, *self.upstreams.values(), *self.proxies.values()]:
            if not proc.alive() and proc.name not in self._restarting:
                await self.start_proc(proc)
        with contextlib.suppress(OSError, TimeoutError, RuntimeError):
            await self.unfill_redis()
