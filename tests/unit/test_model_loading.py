"""Unit tests of rstreamer.model.managed: import strings, model references and predictor loading (no Redis)."""
from __future__ import annotations

import functools
import json
import os
import os.path

import pytest

from rstreamer.errors import ConfigError
from rstreamer.model.managed import ManagedModel, import_string, load_predictor, model_ref


class RecordingModel(ManagedModel):
    def init_model(self, *args, **kwargs):
        self.init_args = args
        self.init_kwargs = kwargs
        self.model = "loaded"

    def predict(self, batch):
        return [(self.gpu_id, item) for item in batch]


class Outer:
    class Inner(RecordingModel):
        pass


class NotAModel:
    def predict(self, batch):
        return batch


class CallablePredictor:
    def __call__(self, batch):
        return batch


def double(batch):
    return [item * 2 for item in batch]


@pytest.fixture
def cuda_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "before")


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("json:dumps", json.dumps),
        ("json.dumps", json.dumps),
        ("os.path:join", os.path.join),
        ("json:JSONEncoder.encode", json.JSONEncoder.encode),
        (f"{__name__}:Outer.Inner", Outer.Inner),
    ],
)
def test_import_string_resolves_module_and_attribute_path(ref, expected):
    assert import_string(ref) is expected


@pytest.mark.parametrize("ref", ["json", "", ":dumps", "json:", "."])
def test_import_string_rejects_a_reference_without_module_or_name(ref):
    with pytest.raises(ConfigError, match="expected 'package.module:Name'"):
        import_string(ref)


@pytest.mark.parametrize(
    "ref, cause",
    [
        ("rstreamer_no_such_module_xyz:Model", ImportError),
        ("rstreamer_no_such_module_xyz.Model", ImportError),
        ("json:no_such_name", AttributeError),
        ("json:JSONEncoder.no_such_method", AttributeError),
    ],
)
def test_import_string_turns_import_failures_into_config_errors(ref, cause):
    with pytest.raises(ConfigError, match="cannot import") as caught:
        import_string(ref)
    assert isinstance(caught.value.__cause__, cause)


@pytest.mark.parametrize("model", [RecordingModel, Outer.Inner, double], ids=["class", "nested", "function"])
def test_model_ref_names_importable_classes_and_functions(model):
    ref = model_ref(model)
    assert ref == f"{model.__module__}:{model.__qualname__}"
    assert import_string(ref) is model


def test_model_ref_leaves_a_string_alone():
    assert model_ref("workers.echo:EchoModel") == "workers.echo:EchoModel"


def test_model_ref_returns_local_classes_and_lambdas_themselves():
    class Local(RecordingModel):
        pass

    def local_predict(batch):
        return batch

    anonymous = lambda batch: batch  # noqa: E731

    for model in (Local, local_predict, anonymous):
        assert model_ref(model) is model


def test_model_ref_returns_main_module_objects_themselves():
    main_class = type("MainModel", (RecordingModel,), {"__module__": "__main__"})
    assert model_ref(main_class) is main_class


def test_model_ref_returns_bound_methods_partials_and_callable_instances_themselves():
    bound = NotAModel().predict
    partial = functools.partial(double)
    instance = CallablePredictor()
    assert model_ref(bound) is bound
    assert model_ref(partial) is partial
    assert model_ref(instance) is instance


def test_load_predictor_builds_a_managed_model_with_init_args_and_gpu(cuda_env):
    predict = load_predictor(RecordingModel, gpu_id=1, init_args=["weights.bin"], init_kwargs={"half": True})
    model = predict.__self__
    assert isinstance(model, RecordingModel)
    assert (model.init_args, model.init_kwargs, model.model) == (("weights.bin",), {"half": True}, "loaded")
    assert model.gpu_id == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert predict(["a", "b"]) == [(1, "a"), (1, "b")]


def test_load_predictor_on_cpu_leaves_cuda_visible_devices_alone(cuda_env):
    predict = load_predictor(RecordingModel)
    assert predict.__self__.gpu_id is None
    assert (predict.__self__.init_args, predict.__self__.init_kwargs) == ((), {})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "before"


def test_load_predictor_imports_a_model_named_by_string(cuda_env):
    predict = load_predictor(f"{__name__}:Outer.Inner", gpu_id=0, init_args=[1])
    assert isinstance(predict.__self__, Outer.Inner)
    assert predict.__self__.init_args == (1,)


def test_load_predictor_returns_a_plain_function_as_is():
    assert load_predictor(double) is double
    assert load_predictor(f"{__name__}:double") is double


def test_load_predictor_accepts_any_batch_callable():
    instance = CallablePredictor()
    assert load_predictor(instance) is instance


@pytest.mark.parametrize(
    "init_args, init_kwargs", [(["weights"], None), (None, {"half": True})], ids=["args", "kwargs"]
)
def test_load_predictor_refuses_init_args_for_a_plain_function(init_args, init_kwargs):
    with pytest.raises(ConfigError, match="ManagedModel"):
        load_predictor(double, init_args=init_args, init_kwargs=init_kwargs)


def test_load_predictor_refuses_a_class_that_is_not_a_managed_model():
    with pytest.raises(ConfigError, match="NotAModel is not a ManagedModel subclass"):
        load_predictor(NotAModel)


@pytest.mark.parametrize("model", [42, None, "json:no_such_name", f"{__name__}:NotAModel"])
def test_load_predictor_refuses_what_is_neither_a_model_nor_a_function(model):
    with pytest.raises(ConfigError):
        load_predictor(model)
