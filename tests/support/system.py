"""System tools some tests need (a browser, promtool): found, or installed from Debian's packages."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

_lock = threading.Lock()
_updated = False


def debian_tool(command: str, package: str) -> tuple[str | None, str]:
    """The path of ``command``, installing Debian's ``package`` first when it is missing.

    Returns ``(path, "")``, or ``(None, why)`` when it is missing and cannot be installed (not
    root, no apt-get, or the install failed): the caller skips with that reason.
    """
    global _updated
    with _lock:
        found = shutil.which(command)
        if found:
            return found, ""
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            return None, f"{command} is missing and cannot be installed here (needs root and apt-get: " \
                         f"apt-get install {package})"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        steps = ([] if _updated else [["apt-get", "update", "-qq"]]) + [["apt-get", "install", "-y", "-qq", package]]
        for step in steps:
            result = subprocess.run(step, env=env, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                return None, f"`{' '.join(step)}` failed: {result.stderr.strip()[-300:]}"
        _updated = True
        found = shutil.which(command)
        return (found, "") if found else (None, f"{package} installed no {command}")


def in_ci() -> bool:
    """Whether the tests run in CI (``.ci/run`` exports CI=1, as CI services do): a tool that is
    missing there is a broken set-up, not a reason to skip."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_debian_tool(command: str, package: str) -> str:
    """:func:`debian_tool`'s path; without it the test skips, or fails in CI (:func:`in_ci`)."""
    path, why = debian_tool(command, package)
    if path is None:
        if in_ci():
            pytest.fail(f"{why} (CI needs it: the tests that use it cannot be skipped there)")
        pytest.skip(why)
    return path
