"""The scaled-out layout's deployment files, each checked by its real tool and against the settings they
set: deploy/compose/scale.yaml (docker-compose config), deploy/nginx/scale.conf (nginx -t, and a real nginx
spreading requests round-robin over two loopback backends), deploy/kubernetes/scale.yaml (its schemas are
checked with the other manifests in tests/test_deploy_files.py).

The layout is being built: these tests say what the files set up, not that a round trip through it works.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from aiohttp import web

from mcpresume.core.headers import SESSION_HEADER
from mcpresume.process.config import Settings, check_advertise_url
from tests.conftest import ServeApp
from tests.support.poll import until
from tests.test_deploy_files import _compose, _settings
from tests.test_load_balancers import _accepts, _free_port, _nginx

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose" / "scale.yaml"
NGINX_SCALE = ROOT / "deploy" / "nginx" / "scale.conf"
KUBERNETES = ROOT / "deploy" / "kubernetes" / "scale.yaml"
HANG_GUARD = 10.0
UPSTREAM = "http://127.0.0.1:8000/mcp"


def _env_settings(env: dict[str, str]) -> Settings:
    fields = {name.removeprefix("MCPRESUME_").lower(): value for name, value in env.items()}
    unknown = set(fields) - set(Settings.model_fields)
    assert not unknown, f"the environment names no setting: {unknown}"
    return _settings(fields)


def _servers(text: str) -> list[str]:
    return re.findall(r"^\s*server (\S+);", text, re.MULTILINE)


# -- compose -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    done = subprocess.run([*_compose(), "-f", str(COMPOSE), "config"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return cast(dict[str, Any], yaml.safe_load(done.stdout))


def test_compose_runs_two_pods_one_redis_and_nginx(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "pod-a", "mcpresume-a", "pod-b", "mcpresume-b", "nginx"}
    subnet = compose["networks"]["scale"]["ipam"]["config"][0]["subnet"]
    advertised = []
    for pod in ("a", "b"):
        upstream, proxy = services[f"pod-{pod}"], services[f"mcpresume-{pod}"]
        # A sidecar: the proxy in the pod's network namespace, the MCP server on its loopback only.
        assert proxy["network_mode"] == f"service:pod-{pod}"
        assert upstream["build"]["target"] == "example-upstream" and Path(proxy["build"]["context"]) == ROOT
        entry = upstream["entrypoint"]
        assert entry[entry.index("--host") + 1] == "127.0.0.1" and "--any-host" not in entry
        assert not upstream.get("ports") and not proxy.get("ports")  # reached through nginx only
        settings = _env_settings(proxy["environment"])
        assert settings.upstream == UPSTREAM
        assert int(entry[entry.index("--port") + 1]) == urlsplit(UPSTREAM).port
        # The shared store: the compose file's Redis.
        store = urlsplit(settings.store)
        assert store.scheme == "redis" and store.hostname == "redis" and store.port == 6379
        # The advertise URL: the pod's fixed address on the network, the proxy's port, the MCP path.
        check_advertise_url(settings.store, settings.advertise_url)
        assert settings.advertise_url is not None
        url = urlsplit(settings.advertise_url)
        address = upstream["networks"]["scale"]["ipv4_address"]
        assert url.hostname == address and address.rsplit(".", 1)[0] == subnet.rsplit(".", 1)[0]
        assert url.port == settings.port and url.path == urlsplit(UPSTREAM).path
        advertised.append(f"{url.hostname}:{url.port}")
    assert len(set(advertised)) == 2
    # nginx: the one published port, with scale.conf, over exactly the pods' advertised addresses.
    nginx = services["nginx"]
    (mount,) = nginx["volumes"]
    source, target = (mount["source"], mount["target"]) if isinstance(mount, dict) else mount.split(":")[:2]
    assert Path(source) == NGINX_SCALE and target == "/etc/nginx/nginx.conf"
    assert sorted(_servers(NGINX_SCALE.read_text())) == sorted(advertised)
    assert [str(p).split(":")[0] for p in nginx["ports"]] == ["127.0.0.1"]
    command = services["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


# -- nginx -------------------------------------------------------------------------------------------------


def test_nginx_accepts_the_scale_config(tmp_path: Path) -> None:
    done = subprocess.run(_nginx(tmp_path, NGINX_SCALE, "-t"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_nginx_scale_config_has_no_affinity_and_streams() -> None:
    code = [line.split("#")[0].strip() for line in NGINX_SCALE.read_text().splitlines()]
    directives = [line for line in code if line]
    for affinity in ("hash", "ip_hash", "sticky", "least_conn", "random"):
        assert not [d for d in directives if d.split()[0] == affinity], affinity
    assert len(_servers(NGINX_SCALE.read_text())) >= 2
    assert "proxy_buffering off;" in directives
    assert "proxy_request_buffering off;" in directives
    assert "proxy_next_upstream error timeout;" in directives  # never a POST retried on another pod


def _scale_conf_for(backends: list[int], listen_port: int) -> str:
    """The shipped config, its pods replaced by the test's backends and its listener by a free port."""
    text = NGINX_SCALE.read_text()
    servers = re.findall(r"^\s*server \S+;\n", text, re.MULTILINE)
    assert len(servers) == len(backends)
    for line, port in zip(servers, backends, strict=True):
        text = text.replace(line, f"        server 127.0.0.1:{port};\n", 1)
    assert "listen 8080;" in text
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen_port};")
    return text.replace("worker_processes auto;", "worker_processes 1;")


@contextlib.asynccontextmanager
async def _running_nginx(tmp_path: Path, backends: list[int]) -> AsyncIterator[int]:
    port = _free_port()
    conf = tmp_path / "scale.conf"
    conf.write_text(_scale_conf_for(backends, port))
    proc = subprocess.Popen(_nginx(tmp_path, conf, "-g", "daemon off;"), stderr=subprocess.PIPE)
    try:
        await until(lambda: proc.poll() is not None or _accepts(port), timeout=30, what="nginx listening")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_nginx_spreads_one_sessions_requests_over_every_pod_and_streams(
    serve: ServeApp, tmp_path: Path
) -> None:
    seen: list[str] = []
    step = asyncio.Event()

    def pod(name: str) -> web.Application:
        async def post(request: web.Request) -> web.Response:
            seen.append(name)
            return web.Response(text=name)

        async def sse(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: first\n\n")
            await step.wait()
            await response.write(b"data: second\n\n")
            return response

        app = web.Application()
        app.router.add_post("/mcp", post)
        app.router.add_get("/mcp", sse)
        return app

    ports = [urlsplit(await serve(pod(name))).port or 0 for name in ("pod-a", "pod-b")]
    async with _running_nginx(tmp_path, ports) as port, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}/mcp"
        for _ in range(4):  # one session's requests: the same Mcp-Session-Id, the same client address
            async with http.post(url, headers={SESSION_HEADER: "sess-1"}, data=b"{}") as resp:
                assert resp.status == 200
        async with http.get(url, headers={SESSION_HEADER: "sess-1"}) as resp:
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), HANG_GUARD)
            assert first == b"data: first\n\n"  # through nginx before the pod wrote the next one
            step.set()
            assert await asyncio.wait_for(resp.content.read(), HANG_GUARD) == b"data: second\n\n"
    assert sorted(seen) == ["pod-a", "pod-a", "pod-b", "pod-b"]  # round-robin: no affinity of any kind
    assert seen[0] != seen[1]


# -- Kubernetes --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(KUBERNETES.read_text()) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value, by the variables defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def test_kubernetes_scales_the_sidecar_pod_over_one_redis(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    assert set(manifests) == {
        ("Deployment", "mcp-server-scaled"),
        ("Service", "mcp-server-scaled"),
        ("Deployment", "mcpresume-redis"),
        ("Service", "mcpresume-redis"),
    }
    deployment = manifests["Deployment", "mcp-server-scaled"]
    assert deployment["spec"]["replicas"] >= 3
    pod = deployment["spec"]["template"]
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == "mcpresume"]
    # The env as the kubelet makes it: the pod IP from the downward API, then $(POD_IP) expanded.
    env: dict[str, str] = {}
    for entry in sidecar["env"]:
        if "valueFrom" in entry:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            env[entry["name"]] = "10.1.2.3"
        else:
            env[entry["name"]] = _expand(entry["value"], env)
    assert env.pop("POD_IP") == "10.1.2.3"
    settings = _env_settings(env)
    check_advertise_url(settings.store, settings.advertise_url)
    (http_port,) = [p["containerPort"] for p in sidecar["ports"] if p["name"] == "http"]
    assert settings.advertise_url == f"http://10.1.2.3:{http_port}{urlsplit(UPSTREAM).path}"
    assert settings.port == http_port and settings.host == "0.0.0.0"
    assert "mcp-server-scaled" in settings.allowed_hosts  # the Service's name (a DNS name: listed)
    assert settings.upstream == UPSTREAM
    # The store: the Redis Service, by its name and port, selecting the Redis pods and only them.
    store = urlsplit(settings.store)
    redis_service = manifests["Service", "mcpresume-redis"]["spec"]
    assert store.scheme == "redis" and store.hostname == "mcpresume-redis"
    assert store.port == redis_service["ports"][0]["port"]
    redis_pod = manifests["Deployment", "mcpresume-redis"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    redis_labels = redis_pod["metadata"]["labels"]
    assert redis_service["selector"].items() <= redis_labels.items()
    assert not redis_service["selector"].items() <= labels.items()
    args = redis_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    # The Service: no affinity, to the proxy's port, selecting the MCP pods and not Redis.
    service = manifests["Service", "mcp-server-scaled"]["spec"]
    assert service.get("sessionAffinity", "None") == "None"
    assert service["selector"].items() <= labels.items()
    assert not service["selector"].items() <= redis_labels.items()
    (port,) = service["ports"]
    assert port["targetPort"] == "http"
    # The MCP server publishes nothing: loopback only, reached through its pod's proxy.
    for container in pod["spec"]["containers"]:
        if container["name"] != "mcpresume":
            assert not container.get("ports")
