"""`rstreamer-worker mymodels:UpperModel` run next to mymodels.py imports it, as gunicorn and uvicorn
would: the working directory is on the import path of the supervisor and of its workers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from rstreamer import RedisStreamer
from support.procs import test_env as child_env
from support.procs import wait_for_workers

BIN = Path(sys.executable).parent

MODELS = """
    from rstreamer import ManagedModel


    class UpperModel(ManagedModel):
        def init_model(self):
            pass

        def predict(self, batch):
            return [text.upper() for text in batch]
"""


def test_worker_imports_a_model_module_from_the_working_directory(redis_url, prefix, tmp_path):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODELS))
    env = child_env()  # rstreamer's checkout and tests/ only: not tmp_path
    command = [str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, "mymodels:UpperModel"]

    check = subprocess.run([*command[:1], "--check", *command[1:]], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr

    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_workers(redis_url, prefix, timeout=60)  # the supervised child imported it too
        with RedisStreamer(redis_url, prefix) as streamer:
            assert streamer.predict(["abc", "Hello"], timeout=30) == ["ABC", "HELLO"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its workers
            proc.wait(timeout=10)
