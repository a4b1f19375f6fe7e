"""Unit tests of the shelf file (rstreamer.shelf.spec): the format, and errors that name the model and field."""
from __future__ import annotations

import json

import pytest

from rstreamer.settings import ShelfSettings, WorkerSettings, parse_bytes
from rstreamer.shelf.spec import ShelfError, load_shelf, parse_shelf

EXAMPLE = {"models": {"sentiment-fr": {"model": "pkg.mod:Class", "init_kwargs": {}, "batch_size": 32,
                                       "max_latency": 0.02}}}


def test_the_issue_example_is_a_valid_shelf():
    shelf = parse_shelf(EXAMPLE)
    assert shelf.name == "default"
    model = shelf.models["sentiment-fr"]
    assert (model.model, model.batch_size, model.max_latency, model.init_kwargs) == ("pkg.mod:Class", 32, 0.02, {})
    settings = model.settings(WorkerSettings())
    assert (settings.batch_size, settings.max_latency) == (32, 0.02)


def test_every_optional_field():
    shelf = parse_shelf({"name": "fleet-1", "models": {"m": {
        "model": "a.b:C", "init_args": [1, "x"], "init_kwargs": {"seed": 3}, "batch_size": 8, "max_latency": 0,
        "max_batch_cost": 512, "cost_model": "SUM", "load_seconds": 2.5, "memory": "1.5GiB"}}})
    model = shelf.models["m"]
    assert shelf.name == "fleet-1"
    assert model.init_args == (1, "x") and model.init_kwargs == {"seed": 3}
    assert (model.max_batch_cost, model.cost_model, model.load_seconds, model.memory) == (512, "sum", 2.5,
                                                                                         int(1.5 * 2**30))
    settings = model.settings(WorkerSettings(batch_size=4))
    assert (settings.batch_size, settings.max_batch_cost, settings.cost_model) == (8, 512, "sum")


def test_unset_batch_settings_are_the_workers_own():
    model = parse_shelf({"models": {"m": {"model": "a:B"}}}).models["m"]
    settings = model.settings(WorkerSettings(batch_size=12, max_latency=0.05))
    assert (settings.batch_size, settings.max_latency) == (12, 0.05)


def test_the_published_view_never_shows_init_arguments():
    shelf = parse_shelf({"models": {"m": {"model": "a:B", "init_kwargs": {"token": "secret"}, "batch_size": 4}}})
    assert "secret" not in json.dumps(shelf.public())
    assert shelf.public() == {"name": "default", "models": {"m": {"model": "a:B", "batch_size": 4}}}
    assert shelf.digest == parse_shelf({"models": {"m": {"model": "a:B", "batch_size": 4}}}).digest
    assert shelf.digest != parse_shelf({"models": {"m": {"model": "a:B", "batch_size": 5}}}).digest


@pytest.mark.parametrize(("data", "message"), [
    ([], "must be a JSON object"),
    ({}, "field 'models' must be a non-empty object"),
    ({"models": {}}, "field 'models' must be a non-empty object"),
    ({"models": {"m": {"model": "a:B"}}, "nmae": "x"}, "unknown field 'nmae'"),
    ({"name": "has space", "models": {"m": {"model": "a:B"}}}, "field 'name': invalid shelf name"),
    ({"models": {"bad name": {"model": "a:B"}}}, "model 'bad name': invalid prefix"),
    ({"models": {"m": "a:B"}}, "model 'm': must be an object"),
    ({"models": {"m": {}}}, "model 'm': field 'model' is required"),
    ({"models": {"m": {"model": "nocolon"}}}, "model 'm': field 'model': expected 'package.module:Name'"),
    ({"models": {"m": {"model": 3}}}, "model 'm': field 'model': must be a string"),
    ({"models": {"m": {"model": "a:B", "batch_size": 0}}}, "model 'm': field 'batch_size': must be an integer >= 1"),
    ({"models": {"m": {"model": "a:B", "batch_size": True}}}, "field 'batch_size': must be an integer >= 1"),
    ({"models": {"m": {"model": "a:B", "max_latency": -1}}}, "field 'max_latency': must be a number of seconds"),
    ({"models": {"m": {"model": "a:B", "max_latency": "fast"}}}, "field 'max_latency'"),
    ({"models": {"m": {"model": "a:B", "max_latncy": 0.1}}}, "model 'm': unknown field 'max_latncy'"),
    ({"models": {"m": {"model": "a:B", "init_args": {}}}}, "field 'init_args': must be a JSON array"),
    ({"models": {"m": {"model": "a:B", "init_kwargs": []}}}, "field 'init_kwargs': must be a JSON object"),
    ({"models": {"m": {"model": "a:B", "cost_model": "max"}}}, "field 'cost_model'"),
    ({"models": {"m": {"model": "a:B", "load_seconds": 0}}}, "field 'load_seconds': must be a number of seconds > 0"),
    ({"models": {"m": {"model": "a:B", "memory": "lots"}}}, "field 'memory': not a size"),
    ({"models": {"m": {"model": "a:B", "max_batch_cost": -1}}}, "field 'max_batch_cost': must be an integer >= 0"),
])
def test_errors_name_the_model_and_the_field(data, message):
    with pytest.raises(ShelfError, match="shelf.json") as raised:
        parse_shelf(data, "shelf.json")
    assert message in str(raised.value)


def test_a_file_that_is_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "shelf.json"
    path.write_text('{"models": {"m": {"model": "a:B",}}}')
    with pytest.raises(ShelfError, match=r"shelf.json: not valid JSON"):
        load_shelf(path)
    with pytest.raises(ShelfError, match="cannot read the shelf file"):
        load_shelf(tmp_path / "missing.json")
    path.write_text(json.dumps(EXAMPLE))
    assert list(load_shelf(path).models) == ["sentiment-fr"]


@pytest.mark.parametrize(("text", "size"), [("0", 0), ("1000", 1000), ("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20),
                                            ("2.5GB", 2_500_000_000), ("3k", 3000)])
def test_sizes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1", "8 parsecs", "1e9"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


def test_shelf_settings_are_checked(monkeypatch):
    monkeypatch.setenv("RSTREAMER_SLOTS", "5")
    monkeypatch.setenv("RSTREAMER_MEMORY_BUDGET", "2GiB")
    monkeypatch.setenv("RSTREAMER_SHELF_POLICY", "LRU")
    settings = ShelfSettings.from_env()
    assert (settings.slots, settings.memory_budget, settings.shelf_policy) == (5, 2 * 2**30, "lru")
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        ShelfSettings(slots=0)
    with pytest.raises(ValueError, match="shelf policy must be one of queue, lru, all"):
        ShelfSettings(shelf_policy="random")
