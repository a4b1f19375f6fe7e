"""Command-line entry points: ``rstreamer`` (demo, status, bench) and ``rstreamer-worker``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rstreamer {demo} [options]")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"rstreamer: unknown command {command!r}", file=sys.stderr)
    return 2


def worker_main(argv: list[str] | None = None) -> int:
    raise SystemExit("rstreamer-worker: not implemented yet")
