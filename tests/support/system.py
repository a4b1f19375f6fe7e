"""System tools some tests need (a browser, promtool, wrk, libfaketime): installed by `make test`
(tests/tools/install.sh, from Debian's packages), only found here."""
from __future__ import annotations

import shutil


def debian_tool(command: str, package: str) -> tuple[str | None, str]:
    """The path of ``command``: ``(path, "")``, or ``(None, why)`` when it is missing; the caller
    skips with that reason (a failure in CI: see tests/conftest.py)."""
    found = shutil.which(command)
    if found:
        return found, ""
    return None, f"{command} is missing: `make test-tools` installs it (apt-get install {package})"
