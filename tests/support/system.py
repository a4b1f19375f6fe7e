"""System tools some tests need (a browser, promtool, wrk, libfaketime): installed by `make test`
(tests/tools/install.sh, from Debian's packages), only found here."""
from __future__ import annotations

import shutil

import pytest


def debian_tool(command: str, package: str) -> tuple[str | None, str]:
    """The path of ``command``: ``(path, "")``, or ``(None, why)`` when it is missing; the caller
    skips with that reason (a failure in CI: see tests/conftest.py)."""
    found = shutil.which(command)
    if found:
        return found, ""
    return None, f"{command} is missing: `make test-tools` installs it (apt-get install {package})"


def require_debian_tool(command: str, package: str) -> str:
    """:func:`debian_tool`'s path; without it the test skips with the reason (a failure in CI:
    tests/conftest.py turns every skip there into one)."""
    path, why = debian_tool(command, package)
    if path is None:
        pytest.skip(why)
    return path
