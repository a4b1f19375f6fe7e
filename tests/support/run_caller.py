"""Run one client call in its own process from a JSON spec (argv[1]), printing a line per chunk
(or one line for a predict), so that a test can SIGKILL a caller mid-call: a dead web process
withdraws nothing, and what it left is for the workers' own checks."""
from __future__ import annotations

import json
import signal
import sys

from rstreamer import RedisStreamer


def main() -> None:
    # Ctrl-C as a terminal delivers it: a process started from a shell's background job (a CI
    # run launched with `&`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = json.loads(sys.argv[1])
    with RedisStreamer(spec["url"], spec["prefix"]) as streamer:
        if spec.get("stream"):
            for chunk in streamer.stream(spec["item"], timeout=spec["timeout"]):
                print(json.dumps(chunk), flush=True)
        else:
            print(json.dumps(streamer.predict(spec["items"], timeout=spec["timeout"])), flush=True)


if __name__ == "__main__":
    main()
