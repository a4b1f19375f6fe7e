"""Every Python block of README.md and docs/*.md runs when pasted into a file.

A block that needs Redis gets the test server (its URL replaces the one in the text) and a
worker for each prefix it names. A block that cannot run on its own says so right before it,
visibly, with ``<!-- not-runnable: reason -->``; it is reported as skipped with that reason.
"""
from __future__ import annotations

import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.procs import ROOT, WorkerProcesses
from support.procs import test_env as child_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
NOT_RUNNABLE = re.compile(r"<!--\s*not-runnable:\s*(.*?)\s*-->\s*$")
REDIS_URL = re.compile(r"redis://(?:localhost|redis):6379/0")
# RedisStreamer("url", "prefix") or RedisStreamer("url", prefix="prefix"), async too
PREFIX = re.compile(r"RedisStreamer\(\s*\"[^\"]*\"\s*,\s*(?:prefix=)?\"([^\"]+)\"")


@dataclass(frozen=True)
class Snippet:
    where: str
    code: str
    not_runnable: str | None


def _snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = [row for row in text[:match.start()].splitlines() if row.strip()]
            marker = NOT_RUNNABLE.search(before[-1]) if before else None
            found.append(Snippet(f"{path.relative_to(ROOT)}:{line}", match.group(1),
                                 marker.group(1) if marker else None))
    return found


SNIPPETS = _snippets()


def test_the_docs_have_python_blocks_and_most_run():
    runnable = [s for s in SNIPPETS if s.not_runnable is None]
    assert len(runnable) >= 5, [s.where for s in SNIPPETS]
    assert len(runnable) > len(SNIPPETS) - len(runnable)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_python_block_runs_when_pasted(snippet: Snippet, redis_url: str, tmp_path: Path, workers: WorkerProcesses):
    if snippet.not_runnable is not None:
        pytest.skip(f"not-runnable: {snippet.not_runnable}")
    code = REDIS_URL.sub(redis_url, snippet.code)
    for name in sorted(set(PREFIX.findall(code))):
        unique = f"{name}-{uuid.uuid4().hex[:8]}"  # the tests share one server
        code = code.replace(f'"{name}"', f'"{unique}"')
        workers.start(unique)
    path = tmp_path / "snippet.py"
    path.write_text(code)
    env = {**child_env(), "RSTREAMER_REDIS_URL": redis_url}
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{snippet.where} failed:\n{code}\n--- stderr\n{done.stderr[-3000:]}"
