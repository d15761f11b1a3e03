"""Starting and stopping the processes under test: the synthetic upstream, nginx and mcpresume.

Every child is started in its own session (so its whole process group can be signalled by its own id) and
with ``PR_SET_PDEATHSIG`` (so it dies if the benchmark is killed). ``Processes.close`` stops them all
(SIGTERM, then SIGKILL after a grace period); ``__main__`` calls it from ``finally`` and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOOPBACK = "127.0.0.1"

_PR_SET_PDEATHSIG = 1


def child_setup() -> None:
    """Runs in the child before exec: die with the parent, and use the hard fd limit."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    with contextlib.suppress(Exception):
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def raise_fd_limit() -> int:
    """Raise this process's soft fd limit to the hard one (root cannot go past the hard one here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (1 << 20, 200_000, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {LOOPBACK}:{port} after {timeout} s")


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (nginx's worker), from /proc/<pid>/task/*/children."""
    return [
        int(found)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for found in (task / "children").read_text().split()
    ]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/mcp"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        # the group, in case a grandchild (an nginx worker) outlived its parent
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(2.0)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def tree(directory: Path, rev: str | None = None) -> Path:
    """``directory`` with a copy of ``mcpresume/``: at git revision ``rev`` (``git archive``), or the
    working tree's (no bytecode). Two proxies compared side by side each run from a copy, so both start
    alike: run from the checkout itself, the second-started one measured ~7% faster than the other on the
    same code (100 streams, A/A)."""
    directory.mkdir(parents=True, exist_ok=True)
    if rev is None:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "mcpresume", directory / "mcpresume", ignore=ignore)
    else:
        archive = subprocess.run(
            ["git", "archive", rev, "mcpresume"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


@dataclass
class Processes:
    """The children of one benchmark run, and their temp dir."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mcpresume-bench-")))
    children: list[Child] = field(default_factory=list)

    def _spawn(
        self, name: str, argv: list[str], port: int, *, stdout_ready: bool = False, root: Path = ROOT
    ) -> Child:
        log = self.tmp / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=str(root),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_ready else out,
                stderr=out,
                start_new_session=True,
                preexec_fn=child_setup,
            )
        child = Child(name, proc, port, log)
        self.children.append(child)
        return child

    def start_upstream(self, module: str = "bench.upstream", name: str = "upstream") -> Child:
        """``module``: ``bench.upstream`` (streams), or ``bench.callee`` (short calls)."""
        return self._start_ready(name, [PYTHON, "-m", module, "--port", "0"])

    def start_floor(self, upstream: Child) -> Child:
        """The floor proxy (``bench.floorproxy``, the thinnest aiohttp reverse proxy) before ``upstream``."""
        argv = [PYTHON, "-m", "bench.floorproxy", "--upstream", upstream.url, "--port", "0"]
        return self._start_ready("floor", argv)

    def _start_ready(self, name: str, argv: list[str]) -> Child:
        """A child that prints ``READY <port>`` once it listens."""
        child = self._spawn(name, argv, 0, stdout_ready=True)
        assert child.proc.stdout is not None
        line = b""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not line.startswith(b"READY"):
            line = child.proc.stdout.readline()
            if not line and child.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {child.log_tail()}")
        if not line.startswith(b"READY"):
            raise TimeoutError(f"{name} did not start")
        child.port = int(line.split()[1])
        child.proc.stdout.close()
        wait_port(child.port, 10, child.proc)
        return child

    def start_redis(self, name: str = "redis") -> Child | None:
        """A redis-server on a free loopback port, persisting nothing (None: not installed)."""
        binary = shutil.which("redis-server")
        if binary is None:
            return None
        port = free_port()
        workdir = self.tmp / name
        workdir.mkdir(exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir), "--maxmemory-policy", "noeviction"]
        child = self._spawn(name, argv, port)
        wait_port(port, 30, child.proc)
        return child

    def start_mcpresume(
        self,
        upstream: Child,
        name: str = "mcpresume",
        *,
        root: Path = ROOT,
        python_args: tuple[str, ...] = (),
        **settings: object,
    ) -> Child:
        """``advertise=True``: pass ``--advertise-url`` (this proxy's own URL), as a shared store needs.
        ``root``: the directory whose ``mcpresume/`` runs (cwd and PYTHONPATH; ``tree``), this checkout's
        by default. ``python_args``: the interpreter's own, before ``-m mcpresume`` (``-m cProfile -o F``)."""
        port = free_port()
        if settings.pop("advertise", False):
            settings["advertise_url"] = f"http://{LOOPBACK}:{port}/mcp"
        argv = [
            PYTHON,
            *python_args,
            "-m",
            "mcpresume",
            "serve",
            "--upstream",
            upstream.url,
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
        ]
        for key, value in settings.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        child = self._spawn(name, argv, port, root=root)
        wait_port(port, 30, child.proc)
        return child

    def start_nginx(self, upstream: Child, workers: int = 1, name: str = "nginx") -> Child | None:
        """``name``: the child's, and its directory's (pid file, logs, temp files) in the run's temp dir."""
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if binary is None:
            return None
        port = free_port()
        conf_dir = self.tmp / name
        conf_dir.mkdir(exist_ok=True)
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (conf_dir / sub).mkdir(exist_ok=True)
        conf = conf_dir / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(
                workers=workers,
                dir=conf_dir,
                port=port,
                upstream_port=upstream.port,
            )
        )
        child = self._spawn(name, [binary, "-p", str(conf_dir), "-c", str(conf), "-g", "daemon off;"], port)
        wait_port(port, 15, child.proc)
        return child

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


NGINX_CONF = """\
worker_processes {workers};
worker_rlimit_nofile 20000;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{
    worker_connections 16000;
}}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    upstream mcp {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://mcp;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""
