"""Caller threads of the benchmarks."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


def run_threads(target: Callable[[], None], count: int) -> float:
    """Run ``target`` in ``count`` daemon threads at once; the seconds until every one returned."""
    started = time.perf_counter()
    threads = [threading.Thread(target=target, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started
