"""Every model the docs and deploy files name exists, and the arguments they give it fit it.

A model reference (``package.module:Class``) in README.md, docs/*.md, docker-compose.yml or
deploy/ must import and be a ManagedModel, and the ``--init-kwargs`` a command line gives it
must bind to its ``init_model``. A name that is only a placeholder is listed below, with why.
"""
from __future__ import annotations

import inspect
import json
import re
import shlex
from pathlib import Path

import pytest

from rstreamer import ManagedModel
from rstreamer.model.managed import import_string

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docker-compose.yml",
           *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
# package.module:Class (modules are lower case); not part of a longer word, path, URL or NAME=RATE:BURST.
REF = re.compile(r"(?<![\w./:=-])([a-z_]\w*(?:\.[a-z_]\w*)*):([A-Z]\w*)\b")
PLACEHOLDERS = {
    "package.module:ModelClass": "the syntax of a reference",
    "module:Class": "the syntax of a reference",
    "mymodels:UperModel": "the misspelt class of an error message shown as an example",
    "workers.embeding:EmbeddingModel": "the misspelt module of an error message shown as an example",
    "mymodels:Model": "the reader's own model in an error message shown as an example",
    "mypkg.models:MyModel": "the reader's own model, moved from service-streamer",
}


def references() -> dict[str, list[str]]:
    """Each model reference found, with where (file:line) it appears."""
    found: dict[str, list[str]] = {}
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in REF.finditer(line):
                found.setdefault(match.group(0), []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


REFERENCES = references()


def test_the_docs_name_models():
    assert {"workers.embedding:EmbeddingModel", "workers.echo:EchoModel", "workers.decoder:TinyDecoder"} <= \
        set(REFERENCES), sorted(REFERENCES)
    assert set(PLACEHOLDERS) <= set(REFERENCES), "a placeholder no doc uses any more: remove it from the list"


@pytest.mark.parametrize("ref", sorted(set(REFERENCES) - set(PLACEHOLDERS)))
def test_every_model_reference_is_a_real_managed_model(ref):
    try:
        model = import_string(ref)
    except Exception as exc:  # ImportError, AttributeError, ConfigError: the reference is wrong
        pytest.fail(f"{ref} (in {', '.join(REFERENCES[ref])}) does not import: {exc}")
    assert inspect.isclass(model) and issubclass(model, ManagedModel), \
        f"{ref} (in {', '.join(REFERENCES[ref])}) is not a ManagedModel subclass"


def worker_command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv) of every ``rstreamer-worker ...`` command line of the docs (continuations joined)."""
    commands = []
    for path in SOURCES:
        text = path.read_text().replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), 1):
            at = line.find("rstreamer-worker ")
            if at < 0 or not REF.search(line):
                continue
            try:
                argv = shlex.split(line[at:].strip("`"))
            except ValueError:
                continue  # prose that quotes part of a command
            commands.append((f"{path.relative_to(ROOT)}:~{number}", argv))
    return commands


@pytest.mark.parametrize("where, argv", worker_command_lines(), ids=[w for w, _ in worker_command_lines()])
def test_init_kwargs_of_documented_commands_fit_the_model(where, argv):
    refs = [arg for arg in argv if REF.fullmatch(arg)]
    if not refs or "--init-kwargs" not in argv or refs[-1] in PLACEHOLDERS:
        return
    kwargs = json.loads(argv[argv.index("--init-kwargs") + 1])
    model = import_string(refs[-1])
    try:
        inspect.signature(model.init_model).bind(None, **kwargs)
    except TypeError as exc:
        pytest.fail(f"{where}: --init-kwargs {kwargs} do not fit {refs[-1]}.init_model: {exc}")
