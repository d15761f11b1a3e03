"""deploy/nginx and deploy/haproxy: checked by the real tools, and the real nginx in front of a real proxy.

The tools come from Debian (nginx-light, haproxy; .ci/run installs them). Without them the tests are
skipped, except under CI (env ``CI`` set), where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.poll import until
from tests.support.proxy import ScriptedClient, running_proxy, sse_events

ROOT = Path(__file__).resolve().parent.parent
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        message = f"{name} not found (Debian: apt-get install {'nginx-light' if name == 'nginx' else name})"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def _nginx(prefix: Path, conf: Path, *args: str) -> list[str]:
    (prefix / "logs").mkdir(exist_ok=True)
    pid = f"pid {prefix / 'nginx.pid'};"
    return [_tool("nginx"), "-p", str(prefix), "-c", str(conf), "-e", "stderr", "-g", pid, *args]


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    found = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value)
    assert found is not None, value
    return int(found.group(1)) * units[found.group(2) or "s"]


# -- the real tools on the files as shipped ----------------------------------------------------------------


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    done = subprocess.run(_nginx(tmp_path, NGINX_CONF, "-t"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr
    assert "[warn]" not in done.stderr, done.stderr


def test_haproxy_accepts_the_config() -> None:
    done = subprocess.run([_tool("haproxy"), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Configuration file is valid" in done.stdout
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr


# -- what the files must say: affinity on Mcp-Session-Id, streaming settings right for SSE -------------------


def _directives(text: str) -> list[str]:
    return [" ".join(line.split("#")[0].split()) for line in text.splitlines() if line.split("#")[0].strip()]


def test_nginx_routes_on_the_session_id_and_streams() -> None:
    lines = _directives(NGINX_CONF.read_text())
    # Affinity: the hash key is the session id where there is one, a random value for initialize.
    assert "map $http_mcp_session_id $mcpresume_route {" in lines
    assert '"" $request_id;' in lines and "default $http_mcp_session_id;" in lines
    assert "hash $mcpresume_route consistent;" in lines
    # SSE: no buffering, HTTP/1.1 keep-alive to the replicas, read timeouts far beyond a quiet stream.
    for directive in (
        "proxy_buffering off;",
        "proxy_cache off;",
        "proxy_request_buffering off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
    ):
        assert directive in lines, directive
    assert any(line.startswith("keepalive ") for line in lines)
    for name in ("proxy_read_timeout", "proxy_send_timeout"):
        (value,) = [line.split()[1].rstrip(";") for line in lines if line.startswith(name + " ")]
        assert _seconds(value) >= 3600, name
    assert not any("non_idempotent" in line for line in lines)  # a POST never runs twice


def test_haproxy_routes_on_the_session_id_and_streams() -> None:
    lines = _directives(HAPROXY_CFG.read_text())
    # Affinity: learned from initialize's answer, matched on every request that carries the id.
    assert "stick store-response res.hdr(mcp-session-id)" in lines
    assert "stick match req.hdr(mcp-session-id)" in lines
    (table,) = [line for line in lines if line.startswith("stick-table ")]
    assert "type string" in table and _seconds(table.split("expire ")[1].split()[0]) > 300  # > session_ttl
    # Streaming: no request buffering, no forced close (keep-alive on both sides), long timeouts.
    assert not any(
        option in line
        for line in lines
        for option in ("http-buffer-request", "httpclose", "http-server-close", "forceclose")
    )
    for name in ("timeout client", "timeout server"):
        (value,) = [line.split()[2] for line in lines if line.startswith(name + " ")]
        assert _seconds(value) >= 3600, name
    # A draining replica leaves the rotation: the check is its /readyz.
    assert "option httpchk GET /readyz" in lines and "http-check expect status 200" in lines


# -- the real nginx in front of a real proxy: a drop and a re-attach through it ------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _nginx_conf_for(replica_port: int, listen_port: int) -> str:
    """The shipped config, its replicas replaced by the test's proxy and its listener by a free port."""
    text = NGINX_CONF.read_text()
    servers = re.findall(r"^\s*server \S+;\n", text, re.MULTILINE)
    assert len(servers) >= 2
    text = text.replace(servers[0], f"        server 127.0.0.1:{replica_port};\n", 1)
    for line in servers[1:]:
        text = text.replace(line, "", 1)
    assert "listen 8080;" in text
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen_port};")
    return text.replace("worker_processes auto;", "worker_processes 1;")


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@contextlib.asynccontextmanager
async def _running_nginx(tmp_path: Path, replica_port: int) -> AsyncIterator[int]:
    port = _free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(_nginx_conf_for(replica_port, port))
    proc = subprocess.Popen(_nginx(tmp_path, conf, "-g", "daemon off;"), stderr=subprocess.PIPE)
    try:
        await until(lambda: proc.poll() is not None or _accepts(port), timeout=30, what="nginx listening")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_drop_and_reattach_through_nginx(example_upstream: str, tmp_path: Path) -> None:
    async with running_proxy(example_upstream) as proxy:
        async with _running_nginx(tmp_path, proxy.port) as port, aiohttp.ClientSession() as http:
            client = ScriptedClient(http, f"http://127.0.0.1:{port}/mcp")
            await client.initialize()
            request_id, body = client.tool_call("count_slowly", {"n": 6, "delay": 0.05})
            before: list[float] = []
            cursor = ""
            async with http.post(client.url, data=body, headers=client.headers()) as response:
                assert response.status == 200 and response.content_type == "text/event-stream"
                async for event in sse_events(response):
                    cursor = event.id.decode() if event.id else cursor
                    if event.data:
                        before.append(orjson.loads(event.data)["params"]["progress"])
                        if len(before) == 2:
                            break  # the client drops here: nginx closes its connection to the proxy
            headers = client.headers(**{"Last-Event-ID": cursor})
            after: list[dict[str, Any]] = []
            async with http.get(client.url, headers=headers) as response:
                assert response.status == 200
                async for event in sse_events(response):
                    if event.data:
                        after.append(orjson.loads(event.data))
        assert before == [1, 2]
        progress = [m["params"]["progress"] for m in after if m.get("method") == "notifications/progress"]
        assert progress == [3, 4, 5, 6]  # only what was missed, each once
        results = [m for m in after if m.get("id") == request_id]
        assert len(results) == 1 and "counted to 6" in orjson.dumps(results[0]).decode()
        metrics = proxy.ctx.metrics.render().decode()
        assert 'mcpresume_resumptions_total{outcome="reattach"} 1.0' in metrics
