"""A job client in a process of its own (argv[1]: JSON spec), for the jobs tests.

``submit``: submits ``items`` (window ``window``), prints the job id, then waits to be killed.
``fetch``: prints ``{"status", "progress", "result"}`` of job ``job_id`` as JSON once it finished.
"""
from __future__ import annotations

import json
import sys
import time

from rstreamer import RedisStreamer


def main() -> None:
    spec = json.loads(sys.argv[1])
    streamer = RedisStreamer(spec["url"], spec["prefix"])
    if spec["mode"] == "submit":
        job = streamer.submit_job(spec["items"], window=spec.get("window"))
        print(job.id, flush=True)
        time.sleep(3600)  # the test SIGKILLs this process
    else:
        job = streamer.job(spec["job_id"])
        result = job.result(timeout=spec.get("timeout", 60))
        print(json.dumps({"status": job.status().value, "progress": list(job.progress().__dict__.values()),
                          "result": [value if not isinstance(value, Exception) else repr(value) for value in result]}))


if __name__ == "__main__":
    main()
