"""rstreamer.worker.preflight.check_model_name: a misspelt class is found from the source, without importing it."""
from __future__ import annotations

import sys
import textwrap

import pytest

from rstreamer.errors import ConfigError
from rstreamer.worker.preflight import check_model_name


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("plain_models", "dynamic_models", "lazy_models", "star_models"):
        sys.modules.pop(name, None)


def write(folder, name, source):
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


def test_a_misspelt_class_is_refused_with_the_close_names(module_dir):
    write(module_dir, "plain_models", """
        import heavy_dependency_never_imported_here
        class UpperModel: pass
        def lower(batch): return batch
        ALIAS = UpperModel
    """)
    for name in ("UpperModel", "lower", "ALIAS", "heavy_dependency_never_imported_here", "UpperModel.predict"):
        check_model_name(f"plain_models:{name}")
    with pytest.raises(ConfigError, match="defines no 'UperModel'; did you mean 'UpperModel'"):
        check_model_name("plain_models:UperModel")
    assert "plain_models" not in sys.modules, "the check never imports the module"


@pytest.mark.parametrize("source", [
    "globals()['Model'] = object\n",
    "def __getattr__(name): return object\n",
    "from os.path import *\n",
])
def test_a_module_that_binds_names_dynamically_is_left_to_the_import(module_dir, source):
    write(module_dir, "dynamic_models", source)
    check_model_name("dynamic_models:Model")


def test_a_missing_module_is_refused(module_dir):
    with pytest.raises(ConfigError, match="no module named 'no_such_models'"):
        check_model_name("no_such_models:Model")


def test_a_misspelt_module_gets_the_modules_it_likely_meant(module_dir):
    (module_dir / "pkg_models").mkdir()
    (module_dir / "pkg_models" / "__init__.py").write_text("")
    write(module_dir / "pkg_models", "embedding", "class EmbeddingModel: pass\n")
    with pytest.raises(ConfigError,
                       match=r"no module named 'pkg_models.embeding'; did you mean 'pkg_models.embedding'"):
        check_model_name("pkg_models.embeding:EmbeddingModel")
    with pytest.raises(ConfigError, match=r"no module named 'pkg_model'; did you mean 'pkg_models'"):
        check_model_name("pkg_model.embedding:EmbeddingModel")
    with pytest.raises(ConfigError, match=r"with dots.*: pkg_models.embedding:EmbeddingModel"):
        check_model_name("pkg_models/embedding.py:EmbeddingModel")
    for ref in ("pkg_models.embedding:", "pkg_models.embedding"):
        with pytest.raises(ConfigError, match=r"is a module; name the model in it after a colon: pkg_models."
                                              r"embedding:ClassName \(it defines the classes EmbeddingModel\)"):
            check_model_name(ref)
    with pytest.raises(ConfigError, match=r"defines no 'Model'; did you mean 'EmbeddingModel'\?$"):
        check_model_name("pkg_models.embedding:Model")
    sys.modules.pop("pkg_models", None)
