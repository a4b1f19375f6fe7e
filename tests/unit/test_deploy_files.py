"""docker-compose.yml, deploy/k8s/*.yaml, deploy/Dockerfile and deploy/redis.conf agree with the code.

Every command they run is a console script or gunicorn, every option exists in the worker CLI's
parser, every RSTREAMER_* variable is read by the code, ports line up, every deployment exports its
metrics where its Prometheus scrapes them, and KEDA scales the workers on the exporter's drain time
of the configured prefix and wakes them from zero.
"""
from __future__ import annotations

import argparse
import configparser
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from rstreamer.settings import ENV_PREFIX, ClientSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


# --- loading -----------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def manifests() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


def manifest(kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/k8s, found {len(found)}"
    return found[0]


def container(deployment: str) -> dict[str, Any]:
    (only,) = manifest("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return only


def console_scripts() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines)  # type: ignore[misc]


def worker_parser() -> argparse.ArgumentParser:
    """The CLI's own parser; fails clearly while the worker CLI does not exist yet."""
    try:
        cli = importlib.import_module("rstreamer.cli")
        return cli.worker_parser()
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"rstreamer.cli.worker_parser() is needed to check the deploy files against the CLI: {exc}")


def healthcheck_argv(check: dict[str, Any]) -> list[str]:
    test = check["test"]
    if isinstance(test, str):
        return shlex.split(test)
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return list(test[1:]) if test[0] == "CMD" else shlex.split(test[1])


def option_value(argv: list[str], *names: str) -> str:
    for i, arg in enumerate(argv):
        if arg in names:
            return argv[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    raise AssertionError(f"none of {names} in {argv}")


def bind_port(argv: list[str]) -> int:
    return int(option_value(argv, "--bind", "-b").rsplit(":", 1)[1])


# --- commands -------------------------------------------------------------------------------


def worker_commands() -> dict[str, list[str]]:
    worker = container("rstreamer-worker")
    return {
        "compose worker command": service("worker")["command"],
        "compose worker healthcheck": healthcheck_argv(service("worker")["healthcheck"]),
        "k8s worker command": container("rstreamer-worker")["command"] + container("rstreamer-worker").get("args", []),
        "k8s worker livenessProbe": worker["livenessProbe"]["exec"]["command"],
        **({"k8s worker readinessProbe": worker["readinessProbe"]["exec"]["command"]} if "readinessProbe" in worker
           else {}),
    }


@pytest.mark.parametrize("where", list(worker_commands()))
def test_worker_commands_are_the_console_script_with_real_options(where):
    argv = worker_commands()[where]
    assert argv[0] in console_scripts(), f"{where}: {argv[0]!r} is not a console script of setup.cfg"
    assert console_scripts()["rstreamer-worker"] == "rstreamer.cli:worker_main"
    known = {option for action in worker_parser()._actions for option in action.option_strings}
    used = {arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith("-")}
    assert used <= known, f"{where}: options {sorted(used - known)} are not options of rstreamer-worker"


def test_worker_liveness_never_asks_redis_and_readiness_does():
    # A liveness probe that PINGs Redis restarts every worker pod during a Redis outage.
    for where, argv in (("compose healthcheck", healthcheck_argv(service("worker")["healthcheck"])),
                        ("k8s livenessProbe", container("rstreamer-worker")["livenessProbe"]["exec"]["command"])):
        assert {"--check", "--liveness"} <= set(argv), f"{where}: {argv} is not the local liveness check"
    readiness = container("rstreamer-worker")["readinessProbe"]["exec"]["command"]
    assert "--check" in readiness and "--liveness" not in readiness, readiness


def test_web_liveness_never_asks_redis_and_readiness_does():
    web = container("rstreamer-web")
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    check = " ".join(healthcheck_argv(service("web")["healthcheck"]))
    assert "/healthz" in check and "/readyz" not in check, check


def test_the_web_liveness_route_answers_without_redis_and_readiness_does_not():
    from webapp.app import create_app
    from webapp.config import WebConfig

    # Nothing listens on port 1: Redis is "down".
    client = create_app(WebConfig("redis://127.0.0.1:1/0", "default", ClientSettings())).test_client()
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 503


def test_the_model_comes_from_the_environment_and_imports():
    from rstreamer.model.managed import import_string

    for where, env in (("compose", service("worker")["environment"]), ("k8s", configmap_data())):
        model = env["RSTREAMER_MODEL"]
        assert callable(import_string(model)), f"{where}: RSTREAMER_MODEL={model!r} does not import"


def web_commands() -> dict[str, list[str]]:
    return {"compose": service("web")["command"], "k8s": container("rstreamer-web")["command"]}


@pytest.mark.parametrize("where", list(web_commands()))
def test_web_command_is_gunicorn_with_the_repo_config_and_app_factory(where):
    argv = web_commands()[where]
    assert argv[0] == "gunicorn"
    assert (ROOT / option_value(argv, "-c", "--config")).is_file()
    module_name, _, factory = argv[-1].partition(":")
    assert factory == "create_app()", argv[-1]
    assert callable(importlib.import_module(module_name).create_app)


def test_web_routes_used_by_probes_exist():
    from webapp.app import create_app
    from webapp.config import WebConfig

    app = create_app(WebConfig("redis://127.0.0.1:1/0", "default", ClientSettings()))
    routes = {rule.rule for rule in app.url_map.iter_rules()}
    probes = container("rstreamer-web")
    assert {probes["readinessProbe"]["httpGet"]["path"], probes["livenessProbe"]["httpGet"]["path"]} <= routes
    assert re.search(r"127\.0\.0\.1:\d+(/\w+)", " ".join(healthcheck_argv(service("web")["healthcheck"]))).group(1) \
        in routes
    assert "/readyz" in routes and "/predict" in routes


# --- ports -------------------------------------------------------------------------------------


def test_compose_ports_match_gunicorn_bind_and_healthcheck():
    port = bind_port(service("web")["command"])
    published = [str(mapping).rsplit(":", 1)[1] for mapping in service("web")["ports"]]
    assert published == [str(port)], "the published container port is gunicorn's"
    check = " ".join(healthcheck_argv(service("web")["healthcheck"]))
    assert re.search(rf"127\.0\.0\.1:{port}/", check), check


def test_k8s_ports_match_gunicorn_bind_probes_and_service():
    web = container("rstreamer-web")
    port = bind_port(web["command"])
    named = {p["name"]: p["containerPort"] for p in web["ports"]}
    assert named == {"http": port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert web[probe]["httpGet"]["port"] in ("http", port)
    (service_port,) = manifest("Service", "rstreamer-web")["spec"]["ports"]
    assert service_port["targetPort"] in ("http", port)
    assert manifest("Service", "rstreamer-web")["spec"]["selector"].items() <= \
        manifest("Deployment", "rstreamer-web")["spec"]["template"]["metadata"]["labels"].items()


# --- environment ---------------------------------------------------------------------------------


def configmap_data() -> dict[str, str]:
    return manifest("ConfigMap", "rstreamer-config")["data"]


def variables_read_by_the_code() -> set[str]:
    cli = importlib.import_module("rstreamer.cli")
    known = set(getattr(cli, "WORKER_ENV", {}).values())
    known |= {ENV_PREFIX + f.name.upper() for cls in (ClientSettings, WorkerSettings) for f in fields(cls)}
    for path in [*ROOT.glob("rstreamer/**/*.py"), *ROOT.glob("webapp/*.py")]:
        known |= set(re.findall(r"RSTREAMER_[A-Z_]+", path.read_text()))
    return known


def test_env_is_defined_once_in_compose():
    worker, web = service("worker")["environment"], service("web")["environment"]
    assert worker is web or worker == web, "worker and web share one environment block (x-rstreamer-env)"
    assert "x-rstreamer-env:" in COMPOSE.read_text()


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_every_variable_set_is_read_by_the_code(where):
    if where == "compose":
        names = set(service("worker")["environment"]) | set(service("web")["environment"])
    else:
        names = set(configmap_data())
        for deployment in ("rstreamer-worker", "rstreamer-web"):
            names |= {item["name"] for item in container(deployment).get("env", [])}
    unknown = {name for name in names if name.startswith("RSTREAMER_")} - variables_read_by_the_code()
    assert not unknown, f"{where} sets variables no code reads: {sorted(unknown)}"
    assert {"RSTREAMER_REDIS_URL", "RSTREAMER_PREFIX", "RSTREAMER_MODEL"} <= names


def test_compose_redis_url_points_at_the_redis_service():
    url = urlsplit(service("worker")["environment"]["RSTREAMER_REDIS_URL"])
    assert url.hostname == "redis" and url.port == 6379
    assert "redis" in compose()["services"]


def test_k8s_redis_url_points_at_the_redis_service():
    secret = manifest("Secret", "rstreamer-redis")["stringData"]
    url = urlsplit(secret["url"])
    redis_service = manifest("Service", url.hostname)
    assert url.port in [p["port"] for p in redis_service["spec"]["ports"]]
    for deployment in ("rstreamer-worker", "rstreamer-web", "rstreamer-exporter"):
        env = {item["name"]: item for item in container(deployment)["env"]}
        assert env["RSTREAMER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "rstreamer-redis", "key": "url"}


# --- KEDA ----------------------------------------------------------------------------------------


def keda_trigger(name: str) -> dict[str, Any]:
    (trigger,) = [t for t in manifest("ScaledObject", "rstreamer-worker")["spec"]["triggers"] if t.get("name") == name]
    return trigger


def test_keda_wakes_the_worker_deployment_from_zero_on_the_first_waiting_item():
    scaled = manifest("ScaledObject", "rstreamer-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    manifest("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert scaled["spec"]["minReplicaCount"] == 0
    trigger = keda_trigger("wake")
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    prefix = configmap_data()["RSTREAMER_PREFIX"]
    # Waiting and pending items of every level: the exporter's gauges, which need no consumer group
    # (a prefix no worker ever served has none) and still speak when no worker is live.
    assert trigger["metadata"]["query"] == (f'sum(rstreamer_queue_length{{prefix="{prefix}"}}) + '
                                            f'sum(rstreamer_queue_pending{{prefix="{prefix}"}})')
    assert trigger["metadata"]["activationThreshold"] == "0"
    assert float(trigger["metadata"]["threshold"]) >= 1000, "it wakes the fleet; the drain time sizes it"
    assert trigger["metadata"]["serverAddress"] == keda_trigger("drain")["metadata"]["serverAddress"]
    # A call to a fleet at zero must reach a web pod and wait there, enqueued, for the wake.
    assert float(configmap_data()["RSTREAMER_COLD_START_WAIT"]) > 0


def test_keda_sizes_the_fleet_on_the_prefix_drain_time():
    trigger = keda_trigger("drain")
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    prefix = configmap_data()["RSTREAMER_PREFIX"]
    assert query == f'sum(rstreamer_queue_drain_seconds{{prefix="{prefix}"}})'
    from rstreamer.ops.metrics import QueueCollector

    assert "rstreamer_queue_drain_seconds" in {name for name, _ in QueueCollector.LEVEL_GAUGES.values()}
    # The threshold is the target drain time, one setting with the exporter's: kustomize copies it.
    rendered = {(doc["kind"], doc["metadata"]["name"]): doc for doc in render_kustomization()}
    target = rendered["ConfigMap", "rstreamer-config"]["data"]["RSTREAMER_DRAIN_TARGET"]
    (drain,) = [t for t in rendered["ScaledObject", "rstreamer-worker"]["spec"]["triggers"] if t["name"] == "drain"]
    assert drain["metadata"]["threshold"] == target and float(target) > 0


def test_worker_pods_request_a_gpu_and_drain_before_the_kill():
    worker = container("rstreamer-worker")
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    grace = manifest("Deployment", "rstreamer-worker")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > WorkerSettings.drain_timeout
    assert compose_seconds(service("worker")["stop_grace_period"]) > WorkerSettings.drain_timeout


def compose_seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)s", str(value))
    assert match, value
    return float(match.group(1))


def test_compose_keeps_a_commented_gpu_reservation_and_two_workers():
    assert service("worker")["deploy"]["replicas"] == 2
    assert re.search(r"#\s*-\s*driver:\s*nvidia", COMPOSE.read_text()), "the GPU reservation, commented"


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


# --- Redis and the image --------------------------------------------------------------------------


def redis_conf() -> dict[str, str]:
    lines = [line.split(None, 1) for line in (DEPLOY / "redis.conf").read_text().splitlines()]
    return {parts[0]: parts[1] if len(parts) > 1 else "" for parts in lines if parts and not parts[0].startswith("#")}


def test_redis_conf_keeps_every_item_on_disk_and_never_evicts():
    conf = redis_conf()
    assert conf["appendonly"] == "yes" and conf["maxmemory-policy"] == "noeviction"
    redis_service = service("redis")
    assert redis_service["image"].startswith("redis:7")
    mounts = {v.split(":")[0]: v.split(":")[1] for v in redis_service["volumes"]}
    assert mounts["./deploy/redis.conf"] in redis_service["command"]
    assert mounts["redis-data"] == conf["dir"] and "redis-data" in compose()["volumes"]


def test_k8s_redis_conf_is_deploy_redis_conf():
    assert manifest("ConfigMap", "rstreamer-redis-conf")["data"]["redis.conf"] == (DEPLOY / "redis.conf").read_text()


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def stages() -> dict[str, str]:
    """The Dockerfile's text per build stage, by name."""
    parts = re.split(r"^FROM (\S+) AS (\w+)$", dockerfile(), flags=re.M)
    return {parts[i + 1]: f"FROM {parts[i]} AS {parts[i + 1]}" + parts[i + 2] for i in range(1, len(parts), 3)}


def test_dockerfile_base_image_is_a_build_arg_with_a_cpu_default():
    text = dockerfile()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    assert "nvidia/cuda" in text, "the CUDA build is documented"
    assert list(stages()) == ["base", "web", "worker"], "the worker image is the default (last) target"


def test_the_web_image_has_no_torch_and_compose_and_k8s_use_it():
    web = stages()["web"]
    assert "torch" not in web.lower() and 'pip install ".[webapp,numpy]"' in web
    assert service("web")["build"]["target"] == "web" and service("worker")["build"]["target"] == "worker"
    assert container("rstreamer-web")["image"].startswith("rstreamer:web")


def test_the_web_app_imports_without_torch():
    # What the web image lacks: importing torch fails there, so nothing of the web app may need it.
    blocker = ("import sys, importlib.abc\n"
               "class NoTorch(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'sentence_transformers', 'transformers'):\n"
               "            raise ImportError(name + ' is not in the web image')\n"
               "sys.meta_path.insert(0, NoTorch())\n"
               "import webapp.app, webapp.asgi, webapp.config, webapp.load, rstreamer\n"
               "webapp.app.create_app(); webapp.asgi.create_app()\n"
               "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_dockerignore_keeps_the_build_context_small():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "demo-output", "bench-output"} <= ignored
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile(), re.M))
    assert not copied & ignored, "a file the image copies is ignored"


def test_dockerfile_installs_the_pinned_torch_before_the_package():
    text = stages()["worker"]
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1)
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert f"torch=={pinned}" in config["options.extras_require"]["torch"]
    torch_at = text.index('pip install "torch==${TORCH_VERSION}"')
    package_at = text.index('pip install ".[')
    assert torch_at < package_at


def test_dockerfile_copies_every_package_setup_cfg_ships():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    packages = {line.strip() for line in config["options.packages.find"]["include"].split() if "." not in line}
    for name in ("web", "worker"):
        copied = set(re.findall(r"^COPY (\w+) \./\1$", stages()[name], re.M))
        assert packages <= copied, f"not copied into the {name} image: {sorted(packages - copied)}"


# --- metrics wherever it is deployed ----------------------------------------------------------------

PROMETHEUS = DEPLOY / "prometheus"
JOBS = {"rstreamer-exporter", "rstreamer-worker", "rstreamer-web"}


def exporter_args(argv: list[str]) -> argparse.Namespace:
    from rstreamer.ops.exporter import parser

    assert argv[:2] == ["rstreamer", "exporter"], argv
    assert console_scripts()["rstreamer"] == "rstreamer.cli:main"
    return parser().parse_args(argv[2:])


def test_compose_runs_the_exporter_listening_for_prometheus():
    args = exporter_args(service("exporter")["command"])
    assert args.host == "0.0.0.0", "bound to the container's interfaces, or Prometheus cannot reach it"
    assert service("exporter")["environment"] is service("worker")["environment"] or \
        service("exporter")["environment"] == service("worker")["environment"]
    assert service("exporter")["build"]["target"] == "web", "the exporter needs no torch"
    assert str(args.port) in " ".join(healthcheck_argv(service("exporter")["healthcheck"]))


def test_compose_workers_export_their_metrics_to_prometheus():
    argv = service("worker")["command"]
    assert option_value(argv, "--metrics-host") == "0.0.0.0"
    port = int(option_value(argv, "--metrics-port"))
    assert str(port) in [str(p) for p in service("worker")["expose"]]
    assert int(compose()["x-rstreamer-env"]["RSTREAMER_WORKERS_PER_GPU"]) == 1, \
        "deploy/prometheus/prometheus.yml scrapes one metrics port per worker container"


def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())


def scrape_jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_compose_prometheus_scrapes_every_service_that_exports_metrics():
    jobs = scrape_jobs(prometheus_config())
    assert set(jobs) == JOBS
    (exporter_target,) = jobs["rstreamer-exporter"]["static_configs"][0]["targets"]
    assert exporter_target == f"exporter:{exporter_args(service('exporter')['command']).port}"
    (workers,) = jobs["rstreamer-worker"]["dns_sd_configs"]
    assert workers["names"] == ["worker"] and workers["port"] == int(option_value(service("worker")["command"],
                                                                                   "--metrics-port"))
    (web,) = jobs["rstreamer-web"]["dns_sd_configs"]
    assert web["names"] == ["web"] and web["port"] == bind_port(service("web")["command"])
    # The rules file mounted where the config loads it, and the config mounted where Prometheus reads it.
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in service("prometheus")["volumes"] if volume.startswith("./"))
    assert mounts["./deploy/grafana/rstreamer-alerts.yml"] in prometheus_config()["rule_files"]
    assert "--config.file=" + mounts["./deploy/prometheus/prometheus.yml"] in service("prometheus")["command"]


def test_compose_grafana_loads_the_board_from_the_compose_prometheus():
    grafana = service("grafana")
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in grafana["volumes"])
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    port = service("prometheus")["ports"][0].split(":")[-1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{port}" and source["isDefault"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "rstreamer.yml").read_text())["providers"]
    board = mounts["./deploy/grafana/rstreamer-dashboard.json"]
    assert Path(board).parent == Path(provider["options"]["path"])


def annotated_pods() -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
    """Deployments whose pods ask to be scraped: their annotations and their one container."""
    found = {}
    for doc in render_kustomization():
        if doc["kind"] != "Deployment":
            continue
        template = doc["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            (only,) = template["spec"]["containers"]
            found[doc["metadata"]["name"]] = (annotations, only)
    return found


def test_k8s_every_rstreamer_deployment_is_scraped_on_its_metrics_port():
    pods = annotated_pods()
    assert set(pods) == JOBS, "the job label is the pod's app.kubernetes.io/name"
    for name, (pod_annotations, container_spec) in pods.items():
        ports = {port["containerPort"] for port in container_spec["ports"]}
        assert int(pod_annotations["prometheus.io/port"]) in ports, name
        assert pod_annotations["prometheus.io/path"] == "/metrics"
    worker = pods["rstreamer-worker"][1]
    argv = worker["command"] + worker.get("args", [])
    assert option_value(argv, "--metrics-host") == "0.0.0.0"
    assert int(option_value(argv, "--metrics-port")) == int(pods["rstreamer-worker"][0]["prometheus.io/port"])
    exporter = pods["rstreamer-exporter"][1]
    args = exporter_args(exporter["command"])
    assert args.host == "0.0.0.0" and args.port == int(pods["rstreamer-exporter"][0]["prometheus.io/port"])
    assert bind_port(pods["rstreamer-web"][1]["command"]) == int(pods["rstreamer-web"][0]["prometheus.io/port"])
    service_ = manifest("Service", "rstreamer-exporter")
    assert service_["spec"]["selector"].items() <= \
        manifest("Deployment", "rstreamer-exporter")["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_prometheus_config_keeps_the_annotated_pods_and_names_jobs_after_them():
    config = yaml.safe_load((PROMETHEUS / "kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    relabel = {rule.get("target_label") or rule["source_labels"][0]: rule for rule in job["relabel_configs"]}
    assert relabel["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]["action"] == "keep"
    assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    assert relabel["__address__"]["source_labels"][1] == "__meta_kubernetes_pod_annotation_prometheus_io_port"
    assert config["rule_files"] == prometheus_config()["rule_files"]


# --- kustomize ---------------------------------------------------------------------------------------


def render_kustomization() -> list[dict[str, Any]]:
    """deploy/k8s as kustomize renders it: its resources with its replacements applied.

    Rendered here in Python (kustomize is not a Debian package, and kubernetes-client's is too old
    for replacements); :func:`test_the_python_render_is_kustomize_s` compares it with a real
    kustomize wherever one is installed. Fields this render does not know fail, never pass silently.
    """
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "replacements"}
    assert not unknown, f"kustomization.yaml uses {sorted(unknown)}: teach render_kustomization() about them"
    documents = [doc for name in kustomization["resources"]
                 for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    for replacement in kustomization.get("replacements", []):
        source = _selected(documents, replacement["source"])
        (value,) = [_field(doc, replacement["source"]["fieldPath"]) for doc in source]
        for target in replacement["targets"]:
            for doc in _selected(documents, target["select"]):
                for path in target["fieldPaths"]:
                    _set_field(doc, path, value)
    return documents


def _selected(documents: list[dict[str, Any]], select: dict[str, str]) -> list[dict[str, Any]]:
    found = [doc for doc in documents if doc["kind"] == select["kind"] and doc["metadata"]["name"] == select["name"]]
    assert found, f"no {select} in deploy/k8s"
    return found


def _steps(path: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]|[^.\[\]]+", path)


def _step(node: Any, step: str) -> Any:
    if step.startswith("["):
        key, value = step[1:-1].split("=", 1)
        (item,) = [item for item in node if str(item.get(key)) == value]
        return item
    return node[step]


def _field(doc: dict[str, Any], path: str) -> Any:
    node: Any = doc
    for step in _steps(path):
        node = _step(node, step)
    return node


def _set_field(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = _steps(path)
    node: Any = doc
    for step in parents:
        node = _step(node, step)
    assert last in node, f"{path}: kustomize replaces fields that exist"
    node[last] = value


def kustomize_command() -> list[str] | None:
    import shutil

    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def test_the_python_render_is_kustomize_s():
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize or kubectl here: the Python render stands alone")
    done = subprocess.run([*command, str(K8S)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "replacements" in done.stderr:
        pytest.skip(f"{command[0]} is too old for replacements: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    real = {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(done.stdout) if doc}
    ours = {(doc["kind"], doc["metadata"]["name"]): doc for doc in render_kustomization()}
    assert real == ours


def test_the_rendered_manifests_hold_together():
    rendered = render_kustomization()
    names = [(doc["kind"], doc["metadata"]["name"]) for doc in rendered]
    assert len(names) == len(set(names)), "no object twice"
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rstreamer", doc["metadata"]["name"]
        if doc["kind"] == "Deployment":
            selector = doc["spec"]["selector"]["matchLabels"]
            assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
            for ref in doc["spec"]["template"]["spec"]["containers"][0].get("envFrom", []):
                assert ("ConfigMap", ref["configMapRef"]["name"]) in names
