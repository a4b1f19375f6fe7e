"""rstreamer-worker arguments: command line > environment > default; clear errors; no Redis."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

from rstreamer import cli
from rstreamer.errors import ConfigError
from rstreamer.worker.placement import child_environment, per_gpu

BASE = ["--prefix", "p", "support.models:Doubler"]


def parse(argv, env=None):
    return cli.parse_worker_args(argv, env or {})


def test_defaults():
    args = parse(BASE)
    assert (args.redis, args.gpus, args.workers_per_gpu, args.batch_size, args.max_latency) == (
        "redis://localhost:6379/0", [], 1, 64, 0.1)
    assert (args.init_args, args.init_kwargs, args.metrics_port, args.log_level, args.check) == ([], {}, None, "INFO",
                                                                                                  False)
    assert args.metrics_host == "127.0.0.1"  # this machine only, as the dashboard


def test_every_option_from_the_environment():
    env = {"RSTREAMER_REDIS_URL": "redis://r:1/2", "RSTREAMER_PREFIX": "envp", "RSTREAMER_GPUS": "0,1",
           "RSTREAMER_WORKERS_PER_GPU": "2", "RSTREAMER_BATCH_SIZE": "8", "RSTREAMER_MAX_LATENCY": "0.5",
           "RSTREAMER_INIT_ARGS": "[1]", "RSTREAMER_INIT_KWARGS": '{"a": 2}', "RSTREAMER_METRICS_PORT": "9000",
           "RSTREAMER_LOG_LEVEL": "debug", "RSTREAMER_LOG_INTERVAL": "5", "RSTREAMER_MAX_RESTARTS": "0",
           "RSTREAMER_MAX_BATCH_COST": "4096", "RSTREAMER_COST_MODEL": "SUM", "RSTREAMER_MODEL": "m:C",
           "RSTREAMER_WAIT_FOR_REDIS": "30", "RSTREAMER_PRIORITIES": "8,1", "RSTREAMER_LEVEL_MAX_QUEUE": "0,500",
           "RSTREAMER_TENANT_RATE": "50", "RSTREAMER_TENANT_BURST": "100", "RSTREAMER_TENANT_QUOTAS": "acme=500:1000",
           "RSTREAMER_TENANT_SHARING": "Fair", "RSTREAMER_WEBHOOK_ALLOW": "10.0.0.0/8,hooks.internal",
           "RSTREAMER_METRICS_HOST": "0.0.0.0", "RSTREAMER_SHELF": "", "RSTREAMER_SLOTS": "4",
           "RSTREAMER_MEMORY_BUDGET": "2GiB", "RSTREAMER_SHELF_POLICY": "LRU"}
    args = parse([], env)
    assert vars(args) == {"redis": "redis://r:1/2", "prefix": "envp", "gpus": [0, 1], "workers_per_gpu": 2,
                          "batch_size": 8, "max_latency": 0.5, "init_args": [1], "init_kwargs": {"a": 2},
                          "metrics_port": 9000, "log_level": "DEBUG", "log_interval": 5.0, "max_restarts": 0,
                          "max_batch_cost": 4096, "cost_model": "sum", "model": "m:C", "check": False,
                          "liveness": False, "wait_for_redis": 30.0, "priorities": "8,1", "level_max_queue": "0,500",
                          "tenant_rate": 50.0, "tenant_burst": 100, "tenant_quotas": "acme=500:1000",
                          "tenant_sharing": "fair", "webhook_allow": "10.0.0.0/8,hooks.internal",
                          "metrics_host": "0.0.0.0", "shelf": None, "slots": 4, "memory_budget": 2 * 2**30,
                          "shelf_policy": "lru"}
    assert set(env) == set(cli.WORKER_ENV.values())


def test_a_shelf_replaces_the_model_and_the_prefix(capsys):
    args = parse(["--shelf", "shelf.json", "--slots", "2", "--memory-budget", "512MiB"], {"RSTREAMER_PREFIX": "envp"})
    assert (args.shelf, args.slots, args.memory_budget, args.model, args.prefix) == ("shelf.json", 2, 512 * 2**20,
                                                                                     None, None)
    assert parse([], {"RSTREAMER_SHELF": "s.json"}).shelf == "s.json"
    with pytest.raises(SystemExit):
        parse(["--shelf", "shelf.json", "--prefix", "p"], {})
    assert "give no model and no --prefix with it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--shelf", "shelf.json", "--slots", "0"], {})
    assert "--slots" in capsys.readouterr().err


def test_command_line_beats_environment():
    env = {"RSTREAMER_BATCH_SIZE": "8", "RSTREAMER_PREFIX": "envp", "RSTREAMER_MODEL": "env:Model"}
    args = parse(["--batch-size", "16", "--prefix", "clip", "cli:Model"], env)
    assert (args.batch_size, args.prefix, args.model) == (16, "clip", "cli:Model")


def test_a_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(BASE, {"RSTREAMER_BATCH_SIZE": "lots"})
    assert exit_info.value.code == 2
    assert "RSTREAMER_BATCH_SIZE='lots': not an integer" in capsys.readouterr().err


def test_a_bad_environment_value_is_ignored_when_the_command_line_sets_it():
    assert parse(["--batch-size", "4", *BASE], {"RSTREAMER_BATCH_SIZE": "lots"}).batch_size == 4


@pytest.mark.parametrize("argv, message", [
    (["--prefix", "p"], "model"),
    (["m:C"], "--prefix"),
    (["--batch-size", "0", *BASE], "between 1"),
    (["--max-latency", "-1", *BASE], ">= 0"),
    (["--gpus", "0,x", *BASE], "comma-separated"),
    (["--init-args", '{"a": 1}', *BASE], "JSON array"),
    (["--init-kwargs", "[1", *BASE], "not valid JSON"),
    (["--metrics-port", "70000", *BASE], "between 1 and 65535"),
    (["--log-level", "LOUD", *BASE], "unknown log level"),
    (["--priorities", "8,0", *BASE], "every weight must be an integer >= 1"),
    (["--level-max-queue", "10,x", *BASE], "comma-separated list of integers"),
    (["--tenant-quotas", "acme=fast", *BASE], "expected name=rate:burst"),
    (["--tenant-quotas", "a b=1:2", *BASE], "invalid tenant"),
    (["--liveness", *BASE], "--liveness goes with --check"),
    (["--webhook-allow", "10.0.0.0/33", *BASE], "webhook allow-list entry"),
])
def test_invalid_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_build_worker_spec():
    args = parse(["--redis", "127.0.0.1:7000", "--init-kwargs", '{"delay": 0.1}', "--metrics-port", "9100",
                  "--batch-size", "4", *BASE])
    spec = cli.build_worker_spec(args)
    assert (spec.redis_url, spec.prefix, spec.model, spec.settings.batch_size) == (
        "redis://127.0.0.1:7000/0", "p", "support.models:Doubler", 4)
    assert (spec.init_args, spec.init_kwargs, spec.metrics_port, spec.log_level) == (None, {"delay": 0.1}, 9100, "INFO")
    args = parse(["--priorities", "8,2,1", "--level-max-queue", "0,0,99", *BASE])
    levels = cli.build_worker_spec(args).settings.levels()
    assert (levels.weights, levels.max_queue) == ((8, 2, 1), (0, 0, 99))


@pytest.mark.parametrize("argv, message", [
    (["--priorities", "8,1", "--level-max-queue", "5", *BASE], "one bound per level"),
    (["--prefix", "p", "no_such_module_abc:Model"], "no module named 'no_such_module_abc'"),
    (["--prefix", "p", "Model"], "package.module:Name"),
    (["--prefix", "bad prefix!", "support.models:Doubler"], "invalid prefix"),
])
def test_build_worker_spec_refuses_bad_config(argv, message):
    with pytest.raises(ConfigError, match=message):
        cli.build_worker_spec(parse(argv))


def test_check_refuses_a_bad_prefix_before_touching_redis():
    healthy, message = cli.check_worker(argparse.Namespace(redis="redis://127.0.0.1:1/0", prefix="a b", model="m:C"))
    assert not healthy and "invalid prefix" in message


def test_scrub_removes_the_password_from_messages():
    assert cli._scrub("auth failed for s3cret", "redis://user:s3cret@h:1/0") == "auth failed for ***"
    assert cli._scrub("no password here", "redis://h:1/0") == "no password here"


def test_per_gpu_placement_and_child_environment(monkeypatch):
    assert per_gpu([0, 1], 2) == [0, 0, 1, 1]
    assert per_gpu([], 3) == [None, None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with child_environment(1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with child_environment(0):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    with child_environment(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_rstreamer_dispatch(capsys, monkeypatch):
    assert cli.main(["--help"]) == 0 and "status" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2 and "unknown command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["worker", "--help"])
    assert exit_info.value.code == 0 and "rstreamer-worker" in capsys.readouterr().out
    calls = []

    class FakeBench:
        @staticmethod
        def main(argv):
            calls.append(argv)
            return 0

    monkeypatch.setitem(sys.modules, "rstreamer_tools.bench", FakeBench)
    assert cli.bench_main(["--x"]) == 0 and calls == [["--x"]]


def test_bench_missing_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rstreamer_tools.bench", None)  # import raises ImportError
    assert cli.bench_main([]) == 2
    assert "rstreamer bench: not available" in capsys.readouterr().err
