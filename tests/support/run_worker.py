"""Run one RedisWorker process from a JSON spec (argv[1]); used by the process fixtures."""
from __future__ import annotations

import json
import logging
import sys
import time

from rstreamer import RedisWorker, WorkerSettings


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=spec.get("log_level", "WARNING"), format="%(asctime)s worker %(levelname)s %(message)s")
    settings = WorkerSettings(**spec.get("settings", {}))
    if spec.get("supervised"):
        from rstreamer.worker.supervisor import Supervisor, WorkerSpec

        batching = settings.replace(batch_size=spec.get("batch_size", 16), max_latency=spec.get("max_latency", 0.02))
        worker_spec = WorkerSpec(spec["model"], spec["url"], spec["prefix"], init_kwargs=spec.get("init_kwargs"),
                                 settings=batching, log_level=spec.get("log_level", "WARNING"))
        raise SystemExit(Supervisor(worker_spec, [None] * spec["supervised"]).run())
    if spec.get("shelf"):
        from rstreamer.settings import ShelfSettings
        from rstreamer.shelf.spec import parse_shelf
        from rstreamer.worker.shelf import ShelfWorker

        shelf = parse_shelf(spec["shelf"], "shelf", settings)
        ShelfWorker(shelf, spec["url"], settings=ShelfSettings(**spec.get("shelf_settings", {})),
                    worker_settings=settings).run_forever()
        return
    worker = RedisWorker(
        spec["model"], spec.get("batch_size", 16), spec.get("max_latency", 0.02), spec["url"], spec["prefix"],
        model_init_kwargs=spec.get("init_kwargs"), settings=settings, adaptive=spec.get("adaptive", True),
    )
    worker.run_forever(*spec.get("run_args", []))
    # A program that goes on after the worker drained (cleanup, a second phase) must not be ended.
    time.sleep(spec.get("linger", 0.0))


if __name__ == "__main__":
    main()
