"""docker-compose.yml, deploy/k8s/*.yaml, deploy/Dockerfile and deploy/redis.conf agree with the code.

Every command they run is a console script or gunicorn, every option exists in the worker CLI's
parser, every RSTREAMER_* variable is read by the code, ports line up, and the KEDA scaler
watches the stream and group that rstreamer.wire.keys names.
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
from rstreamer.wire.keys import GROUP, Keys

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
    for path in [*ROOT.glob("rstreamer/*.py"), *ROOT.glob("webapp/*.py")]:
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


def test_k8s_redis_url_and_keda_address_point_at_the_redis_service():
    secret = manifest("Secret", "rstreamer-redis")["stringData"]
    url = urlsplit(secret["url"])
    redis_service = manifest("Service", url.hostname)
    assert url.port in [p["port"] for p in redis_service["spec"]["ports"]]
    trigger = keda_trigger()
    assert trigger["metadata"]["address"] == f"{url.hostname}:{url.port}"
    assert trigger["metadata"].get("databaseIndex", "0") == (url.path.strip("/") or "0")
    for deployment in ("rstreamer-worker", "rstreamer-web"):
        env = {item["name"]: item for item in container(deployment)["env"]}
        assert env["RSTREAMER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "rstreamer-redis", "key": "url"}


# --- KEDA ----------------------------------------------------------------------------------------


def keda_trigger() -> dict[str, Any]:
    (trigger,) = manifest("ScaledObject", "rstreamer-worker")["spec"]["triggers"]
    return trigger


def test_keda_scales_the_worker_deployment_on_the_prefix_stream_lag():
    scaled = manifest("ScaledObject", "rstreamer-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    manifest("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    trigger = keda_trigger()
    assert trigger["type"] == "redis-streams"
    metadata = trigger["metadata"]
    assert metadata["stream"] == Keys(configmap_data()["RSTREAMER_PREFIX"]).requests
    assert metadata["consumerGroup"] == GROUP
    # Lag mode: lagCount (+ activationLagCount), not pendingEntriesCount or streamLength.
    assert int(metadata["lagCount"]) > 0 and int(metadata["activationLagCount"]) >= 0
    assert not {"pendingEntriesCount", "streamLength"} & set(metadata)
    auth = manifest("TriggerAuthentication", trigger["authenticationRef"]["name"])
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["key"] in manifest("Secret", ref["name"])["stringData"]


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
               "import webapp.app, webapp.asgi, webapp.gate, webapp.load, rstreamer\n"
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
