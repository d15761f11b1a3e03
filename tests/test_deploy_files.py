"""The deployment files say what the code does: settings, ports, admin paths and metric names.

Each file is also checked by a real tool: hadolint on the Dockerfile, promtool on the alert rules (and their
unit tests), the Kubernetes OpenAPI schemas (kubernetes-validate) on the manifests. The image itself is built
and run by deploy/image-smoke.sh (.ci/run); the load balancers' files by tests/test_load_balancers.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from subprocess import DEVNULL
from typing import Any, cast

import pytest
import yaml

from mcpresume.core.resume import OUTCOMES
from mcpresume.daemon.app import build_admin_app
from mcpresume.process.config import Settings
from mcpresume.process.drain import DRAIN_GRACE
from mcpresume.process.metrics import Metrics
from tests.support.proxy import running_proxy

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "deploy" / "kubernetes" / "sidecar.yaml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "mcpresume.json"
DOCKERFILE = ROOT / "Dockerfile"
UPSTREAM = "http://127.0.0.1:8000/mcp"
UPSTREAM_PORT = 8000


def _settings(values: dict[str, Any]) -> Settings:
    """``values`` over the defaults, ignoring any MCPRESUME_* variables of the test's own environment."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("MCPRESUME_"):
                patch.delenv(name)
        return Settings.model_validate(values)


def _admin_paths() -> set[str]:
    # The admin app's handlers only use the context when called: building it needs none.
    admin = build_admin_app(cast(Any, None), lambda: True)
    return {route.resource.canonical for route in admin.router.routes() if route.resource is not None}


def _exported_metric_names() -> set[str]:
    """Names as Prometheus sees them: prometheus_client adds ``_total`` to a Counter's name, ``_info`` to an
    Info's. The proxy's
    own (``mcpresume_*``): the process collector's standard ``process_*`` ones are every Python exporter's,
    shown by the dashboards made for them (this one graphs the memory, with the version)."""
    names = set()
    for family in Metrics().registry.collect():
        if family.name.startswith("mcpresume_"):
            suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
            names.add(family.name + suffix)
    return names


def _source_string_literals() -> set[str]:
    text = "\n".join(path.read_text() for path in (ROOT / "mcpresume").rglob("*.py"))
    return set(re.findall(r'"([a-z_]+)"', text))


# -- Kubernetes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(SIDECAR.read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def pod(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return cast(dict[str, Any], manifests["Deployment"]["spec"]["template"])


@pytest.fixture(scope="module")
def sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "mcpresume"]
    return cast(dict[str, Any], container)


@pytest.fixture(scope="module")
def sidecar_settings(sidecar: dict[str, Any]) -> Settings:
    """The settings the sidecar runs with: its MCPRESUME_* env over the defaults (the image's own env
    only sets the two hosts)."""
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    fields = {name.removeprefix("MCPRESUME_").lower(): value for name, value in env.items()}
    unknown = set(fields) - set(Settings.model_fields)
    assert not unknown, f"sidecar env names no setting: {unknown}"
    return _settings(fields)


def _port(container: dict[str, Any], ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == ref]
    return cast(int, port)


def test_manifest_kinds(manifests: dict[str, dict[str, Any]]) -> None:
    assert set(manifests) == {"Deployment", "Service"}


def test_sidecar_points_at_the_upstream_container(
    sidecar_settings: Settings, manifests: dict[str, dict[str, Any]]
) -> None:
    assert sidecar_settings.upstream == UPSTREAM
    assert sidecar_settings.host == "0.0.0.0"  # the kubelet and the Service reach it on the pod IP
    assert sidecar_settings.metrics_host in (None, "0.0.0.0")
    # Off loopback only IP addresses and localhost pass by default: the Service's name must be listed.
    service = manifests["Service"]["metadata"]["name"]
    assert {service, f"{service}.default.svc.cluster.local"} <= set(sidecar_settings.allowed_hosts)


def test_sidecar_ports_match_its_settings(sidecar: dict[str, Any], sidecar_settings: Settings) -> None:
    assert _port(sidecar, "http") == sidecar_settings.port == 8080
    assert _port(sidecar, "admin") == sidecar_settings.metrics_port == 9464


def test_probes_hit_admin_paths_that_exist(sidecar: dict[str, Any], sidecar_settings: Settings) -> None:
    paths = _admin_paths()
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path
        assert get["path"] in paths
        assert _port(sidecar, get["port"]) == sidecar_settings.metrics_port


def test_scrape_annotations(pod: dict[str, Any], sidecar_settings: Settings) -> None:
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == sidecar_settings.metrics_port
    assert annotations["prometheus.io/path"] in _admin_paths()


def test_grace_period_covers_prestop_and_drain(
    pod: dict[str, Any], sidecar: dict[str, Any], sidecar_settings: Settings
) -> None:
    command = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # The drain ends every client view by drain_timeout, and each response within DRAIN_GRACE after it.
    needed = pre_stop + sidecar_settings.drain_timeout + DRAIN_GRACE
    assert pod["spec"]["terminationGracePeriodSeconds"] > needed
    (upstream,) = [c for c in pod["spec"]["containers"] if c["name"] != "mcpresume"]
    assert float(upstream["lifecycle"]["preStop"]["exec"]["command"][1]) >= needed  # serves while it drains
    assert sidecar_settings.drain_timeout > 0


def test_sidecar_security_context(sidecar: dict[str, Any]) -> None:
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["runAsUser"] == 10001  # the image's user (Dockerfile USER)


def test_service_targets_the_proxy_never_the_upstream(
    manifests: dict[str, dict[str, Any]], pod: dict[str, Any], sidecar: dict[str, Any]
) -> None:
    service = manifests["Service"]["spec"]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(key) == value for key, value in service["selector"].items())
    (port,) = service["ports"]
    assert port["port"] == 80
    assert _port(sidecar, port["targetPort"]) == 8080 != UPSTREAM_PORT
    # The upstream container publishes nothing: it listens on loopback only.
    for container in pod["spec"]["containers"]:
        if container["name"] != "mcpresume":
            assert not container.get("ports")


def test_in_memory_sessions_stay_on_one_replica(
    manifests: dict[str, dict[str, Any]], sidecar_settings: Settings
) -> None:
    assert sidecar_settings.store == "memory"
    assert manifests["Service"]["spec"]["sessionAffinity"] == "ClientIP"
    assert manifests["Deployment"]["spec"]["replicas"] == 1


# -- Prometheus alerts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_alerts_use_only_metrics_that_exist(rules: list[dict[str, Any]]) -> None:
    exported = _exported_metric_names()
    used = {name for rule in rules for name in re.findall(r"\bmcpresume_\w+", rule["expr"])}
    assert used, "no mcpresume metric in any alert"
    assert used <= exported, f"alerts use metrics mcpresume does not export: {used - exported}"
    # The ones the brief asks for are all watched.
    for name in (
        "mcpresume_resumptions_total",
        "mcpresume_upstream_errors_total",
        "mcpresume_sessions",
        "mcpresume_synthesized_errors_total",
        "mcpresume_evicted_events_total",
    ):
        assert name in used


def _label_values(expr: str) -> list[str]:
    """The values an expression matches the outcome and reason labels against."""
    found = re.findall(r'\b(?:outcome|reason)\s*(?:=|!=|=~|!~)\s*"([^"]*)"', expr)
    return [part for value in found for part in value.split("|")]


def test_alert_label_values_exist_in_the_code(rules: list[dict[str, Any]]) -> None:
    literals = _source_string_literals()
    for rule in rules:
        for value in _label_values(rule["expr"]):
            assert value in literals, f"{rule['alert']}: label value {value!r} never produced by the code"


def test_alerts_say_what_to_do(rules: list[dict[str, Any]]) -> None:
    assert len({rule["alert"] for rule in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
        assert len(rule["annotations"]["description"]) > 80


def test_sessions_alert_threshold_is_a_fraction_of_the_exported_max(rules: list[dict[str, Any]]) -> None:
    (rule,) = [r for r in rules if "mcpresume_sessions" in r["expr"]]
    fraction = float(re.findall(r">\s*([0-9.]+)\s*\*", rule["expr"])[-1])
    assert 0.5 <= fraction < 1
    assert "mcpresume_max_sessions" in rule["expr"]


# -- Grafana dashboard -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(DASHBOARD.read_text()))


def _graphs(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def test_dashboard_shows_every_metric_and_only_metrics_that_exist(dashboard: dict[str, Any]) -> None:
    exprs = [target["expr"] for panel in _graphs(dashboard) for target in panel["targets"]]
    exported = _exported_metric_names()
    # A histogram is queried by its series (_bucket, _sum, _count): each counts as the histogram.
    series = {f"{name}{suffix}": name for name in exported for suffix in ("_bucket", "_sum", "_count")}
    used = {series.get(name, name) for expr in exprs for name in re.findall(r"\bmcpresume_\w+", expr)}
    assert used <= exported, f"the dashboard uses metrics mcpresume does not export: {used - exported}"
    assert exported <= used, f"metrics the dashboard does not show: {exported - used}"


def test_dashboard_label_values_exist_in_the_code(dashboard: dict[str, Any]) -> None:
    literals = _source_string_literals()
    for panel in _graphs(dashboard):
        for target in panel["targets"]:
            for value in _label_values(target["expr"]):
                assert value in literals, (
                    f"{panel['title']}: label value {value!r} never produced by the code"
                )


def test_every_resume_outcome_is_exported_before_the_first_resume() -> None:
    # The dashboard's re-attach share divides the reattach series by all: without the series at 0 it shows
    # "No data" while every resume is refused, and rate() misses a series' first increment.
    rendered = Metrics().render().decode()
    for outcome in (*OUTCOMES, "too_many_attachments"):  # the decision's, and the view's admission
        assert f'mcpresume_resumptions_total{{outcome="{outcome}"}} 0.0' in rendered


def test_dashboard_panels_follow_its_variables(dashboard: dict[str, Any]) -> None:
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    for panel in _graphs(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            # every selector is narrowed to the chosen jobs and instances
            selectors = re.findall(r"mcpresume_\w+\{([^}]*)\}", target["expr"])
            assert selectors and len(selectors) == len(re.findall(r"\bmcpresume_\w+", target["expr"]))
            for selector in selectors:
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, target["expr"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_panels_have_unique_ids_and_do_not_overlap(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = [
        {
            (x, y)
            for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
            for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
        }
        for p in panels
    ]
    for first, second in itertools.combinations(range(len(panels)), 2):
        assert not cells[first] & cells[second], (panels[first]["title"], panels[second]["title"])
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)


# -- Dockerfile ------------------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _final_stage() -> dict[str, list[str]]:
    instructions = _instructions()
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in final:
        by_keyword.setdefault(keyword, []).append(rest)
    return by_keyword


def _image_env() -> dict[str, str]:
    pairs = (pair for rest in _final_stage()["ENV"] for pair in shlex.split(rest))
    return dict(pair.split("=", 1) for pair in pairs)


def test_dockerfile_matches_the_defaults() -> None:
    by_keyword = _final_stage()
    defaults = _settings({})
    exposed = {int(port) for rest in by_keyword["EXPOSE"] for port in shlex.split(rest)}
    assert exposed == {defaults.port, defaults.metrics_port}
    env = _image_env()
    assert env["MCPRESUME_HOST"] == env["MCPRESUME_METRICS_HOST"] == "0.0.0.0"
    assert int(env["MCPRESUME_PORT"]) == defaults.port
    assert int(env["MCPRESUME_METRICS_PORT"]) == defaults.metrics_port
    assert by_keyword["USER"] == ["10001:10001"]
    assert by_keyword["ENTRYPOINT"] == ['["mcpresume"]']
    assert by_keyword["CMD"] == ['["serve"]']
    assert by_keyword["STOPSIGNAL"] == ["SIGTERM"]


async def test_the_healthcheck_probes_the_configured_admin_port() -> None:
    (health,) = _final_stage()["HEALTHCHECK"]
    argv = json.loads(health[health.index("CMD") + 3 :])
    assert argv[:2] == ["python", "-c"]
    probe = argv[2]

    async def run_probe(port: int) -> int:
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-c", probe, env={"MCPRESUME_METRICS_PORT": str(port)}, stderr=DEVNULL
        )
        return await done.wait()

    # The probe itself, against a real admin listener on a port of the test's choosing.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        admin_port = sock.getsockname()[1]
    assert await run_probe(admin_port) != 0  # nothing listens there yet
    async with running_proxy("http://127.0.0.1:1/mcp", metrics_port=admin_port):
        assert await run_probe(admin_port) == 0


def test_docker_stop_grace_covers_the_image_drain() -> None:
    # docker stop sends SIGTERM and kills 10 s later: the drain and its margin must end before.
    drain = float(_image_env()["MCPRESUME_DRAIN_TIMEOUT"])
    assert drain > 0 and drain + DRAIN_GRACE < 10
    labels = " ".join(_final_stage()["LABEL"])
    assert f"MCPRESUME_DRAIN_TIMEOUT ({drain:g} s here) + {DRAIN_GRACE:g} s" in labels


def test_dockerfile_builds_without_docker_hub_frontends() -> None:
    text = DOCKERFILE.read_text()
    # A `# syntax=` line makes BuildKit fetch that frontend image from Docker Hub before anything else.
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    froms = [rest.split()[0] for keyword, rest in _instructions() if keyword == "FROM"]
    assert set(froms) == {"python:3.11-slim"}  # the one base deploy/image-smoke.sh stands in for
    # The optional CA bundle for TLS-intercepting proxies: a secret on every builder step that downloads.
    downloads = [
        rest
        for keyword, rest in _instructions()
        if keyword == "RUN" and ("pip wheel" in rest or ("pip install" in rest and "--no-index" not in rest))
    ]
    assert len(downloads) == 3 and all("--mount=type=secret,id=pip-ca " in rest for rest in downloads)
    assert "--secret id=pip-ca,src=" in text  # documented in the header


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


# -- the memory bound, said the same everywhere ----------------------------------------------------------


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


def test_every_document_says_max_total_window_bytes_bounds_memory(
    sidecar: dict[str, Any], sidecar_settings: Settings
) -> None:
    documents = [
        SIDECAR,
        ALERTS,
        ROOT / "config" / "mcpresume.toml",
        ROOT / "docs" / "how-it-works.md",
        ROOT / "docs" / "reference.md",
        ROOT / "deploy" / "kubernetes" / "README.md",
    ]
    for path in documents:
        text = " ".join(path.read_text().split())
        assert "max_total_window_bytes" in text, path
        for claim in ("no process-wide", "40 GiB", "worst case is max_sessions x window_bytes"):
            assert claim not in text, (path, claim)
    # The cap the sidecar runs with fits under its memory limit, with room for the interpreter and the
    # sessions' bookkeeping.
    limit = _bytes(sidecar["resources"]["limits"]["memory"])
    assert sidecar_settings.max_total_window_bytes + (256 << 20) <= limit


def test_the_docs_list_every_upstream_error_reason_the_code_counts() -> None:
    source = "\n".join(path.read_text() for path in (ROOT / "mcpresume").rglob("*.py"))
    counted = set(re.findall(r'upstream_errors\.labels\("([a-z_]+)"\)', source))
    # and the reasons of the errors counted by class (ctx.reject counts every upstream error's reason)
    counted |= {"upstream_unreachable", "upstream_timeout", "upstream_bad_response", "event_too_large"}
    counted |= {"upstream_bad_session_id"}
    assert "stream_dropped" in counted
    (row,) = [
        line
        for line in (ROOT / "docs" / "reference.md").read_text().splitlines()
        if line.startswith("| `mcpresume_upstream_errors_total{reason}`")
    ]
    for reason in counted:
        assert f"`{reason}`" in row, reason


# -- the real tools: promtool on the alert rules, the Kubernetes schemas on the manifests ---------------


def _tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        message = f"{name} not found (Debian: apt-get install {package})"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        [_tool("promtool", "prometheus"), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_every_alert() -> None:
    tests_file = ALERTS.with_name("alerts.test.yaml")
    done = subprocess.run(
        [_tool("promtool", "prometheus"), "test", "rules", tests_file.name],
        cwd=tests_file.parent,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
    # Every alert has a case where it fires, and one where it stays quiet (an empty exp_alerts, or a
    # second series it leaves alone).
    document = yaml.safe_load(tests_file.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in document["tests"]:
        instances = {re.search(r'instance="([^"]+)"', s["series"]).group(1) for s in case["input_series"]}  # type: ignore[union-attr]
        for check in case["alert_rule_test"]:
            fired = {alert["exp_labels"]["instance"] for alert in check["exp_alerts"]}
            (firing if fired else quiet).add(check["alertname"])
            if fired and instances - fired:
                quiet.add(check["alertname"])
    alerts = {
        rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    }
    assert firing == alerts
    assert quiet == alerts


@pytest.mark.parametrize("version", ["1.28.0", "latest"])
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    manifests = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
    assert manifests
    for path in manifests:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                # strict: an unknown field (a typo) is an error, as `kubectl apply --validate=strict` has it
                kubernetes_validate.validate(document, version, strict=True)


def test_the_kubernetes_validator_catches_a_typo(manifests: dict[str, dict[str, Any]]) -> None:
    import copy

    import kubernetes_validate

    broken = copy.deepcopy(manifests["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGett"] = {"path": "/readyz"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


# -- compose: one proxy, the example upstream, Prometheus and Grafana --------------------------------------

COMPOSE = ROOT / "deploy" / "compose" / "single.yaml"


def _compose() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    message = "neither docker-compose nor docker compose (Debian: apt-get install docker-compose)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as `docker-compose config` renders it (paths resolved), after it checked it."""
    done = subprocess.run([*_compose(), "-f", str(COMPOSE), "config"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return cast(dict[str, Any], yaml.safe_load(done.stdout))


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        mounts[target] = Path(source)
    return mounts


def test_compose_runs_the_kit(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"upstream", "mcpresume", "prometheus", "grafana"}
    # The proxy, built from this Dockerfile, in front of the example upstream (a stage of the same file).
    proxy, upstream = services["mcpresume"], services["upstream"]
    assert Path(proxy["build"]["context"]) == ROOT and "target" not in proxy["build"]
    assert upstream["build"]["target"] == "example-upstream"
    assert ("FROM", "python:3.11-slim AS example-upstream") in _instructions()
    assert "--any-host" in " ".join(rest for keyword, rest in _instructions() if keyword == "ENTRYPOINT")
    assert proxy["environment"]["MCPRESUME_UPSTREAM"] == "http://upstream:8000/mcp"
    defaults = _settings({})
    published = {
        int(port["target"]) if isinstance(port, dict) else int(port.split(":")[-1].split("/")[0])
        for port in proxy["ports"]
    }
    assert published == {defaults.port, defaults.metrics_port}
    assert not upstream.get("ports")  # reached through the proxy only
    grace = proxy["stop_grace_period"]
    assert float(grace.removesuffix("s")) > float(_image_env()["MCPRESUME_DRAIN_TIMEOUT"]) + DRAIN_GRACE


def test_compose_prometheus_scrapes_the_proxy_with_the_alert_rules(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    mounts = _mounts(compose["services"]["prometheus"])
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    assert mounts["/etc/prometheus/alerts.yaml"] == ALERTS
    assert config["rule_files"] == ["alerts.yaml"]  # beside the config, as mounted
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] in _admin_paths()
    assert job["static_configs"] == [{"targets": [f"mcpresume:{_settings({}).metrics_port}"]}]
    # promtool on the config and its rules, laid out as in the container
    for path in (config_path, ALERTS):
        (tmp_path / path.name).write_text(path.read_text())
    done = subprocess.run(
        [_tool("promtool", "prometheus"), "check", "config", str(tmp_path / config_path.name)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def test_compose_grafana_has_the_dashboard_and_prometheus(compose: dict[str, Any]) -> None:
    mounts = _mounts(compose["services"]["grafana"])
    dashboards = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/dashboards"] / "mcpresume.yaml").read_text()
    )
    (provider,) = dashboards["providers"]
    folder = provider["options"]["path"]
    assert mounts[f"{folder}/{DASHBOARD.name}"] == DASHBOARD
    sources = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yaml").read_text()
    )
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in " ".join(str(p) for p in compose["services"]["prometheus"]["ports"]) or any(
        isinstance(p, dict) and p.get("target") == 9090 for p in compose["services"]["prometheus"]["ports"]
    )


def test_shellcheck_finds_nothing_in_the_ci_scripts() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    scripts = [ROOT / "deploy" / "image-smoke.sh", ROOT / ".ci" / "run"]
    done = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_document_says_the_redis_store_is_yet_to_come() -> None:
    """The Redis store landed: the docs that told users to wait for it say what to do now."""
    documents = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*.*")]
    stale = [str(path) for path in documents if "store lands" in path.read_text(errors="replace")]
    assert stale == []


def test_the_kubernetes_readme_says_what_the_sessions_alert_compares(rules: list[dict[str, Any]]) -> None:
    (rule,) = [r for r in rules if "mcpresume_sessions" in r["expr"]]
    text = " ".join((ROOT / "deploy" / "kubernetes" / "README.md").read_text().split())
    assert "hard-codes" not in text
    assert "mcpresume_max_sessions" in text and "mcpresume_max_sessions" in rule["expr"]
