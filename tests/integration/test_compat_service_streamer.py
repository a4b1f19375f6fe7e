"""service-streamer users switch by changing one import line: its public names, with its positional
and keyword signatures, behave as they did (its tests and examples, in spirit)."""
from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rstreamer import ManagedModel, RedisStreamer, RedisWorker, Streamer, ThreadedStreamer, run_redis_workers_forever
from rstreamer.broker.embedded import free_port

# The one line a service-streamer user changes.
from rstreamer_tools.processes import stop_group
from support.models import Affine, Doubler, double
from support.procs import live_pids, wait_for_workers, wait_until
from support.procs import test_env as child_env

# service-streamer's positional parameters, in order (self left out).
ORIGINAL_SIGNATURES = {
    ThreadedStreamer: ["predict_function", "batch_size", "max_latency", "worker_timeout"],
    Streamer: ["predict_function_or_model", "batch_size", "max_latency", "worker_num", "cuda_devices",
               "model_init_args", "model_init_kwargs", "wait_for_worker_ready", "mp_start_method", "worker_timeout"],
    RedisStreamer: ["redis_broker", "prefix"],
    RedisWorker: ["model_class", "batch_size", "max_latency", "redis_broker", "prefix", "model_init_args",
                  "model_init_kwargs"],
    run_redis_workers_forever: ["model_class", "batch_size", "max_latency", "worker_num", "cuda_devices",
                                "redis_broker", "prefix", "mp_start_method", "model_init_args", "model_init_kwargs"],
    ManagedModel: ["gpu_id"],
}


def _positional(target: object) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(target).parameters.values() if p.kind in kinds]  # type: ignore[arg-type]


@pytest.mark.parametrize("target", list(ORIGINAL_SIGNATURES), ids=lambda t: t.__name__)
def test_positional_parameters_are_the_originals_in_order(target):
    # Extra parameters are keyword-only, so no positional call of the original shifts.
    assert _positional(target) == ORIGINAL_SIGNATURES[target]


def test_threaded_streamer_positional_and_keyword_forms():
    for streamer in (ThreadedStreamer(double, 8, 0.01, 5),
                     ThreadedStreamer(predict_function=double, batch_size=8, max_latency=0.01, worker_timeout=5)):
        assert streamer.predict([1, 2]) == [2, 4]
        futures = [streamer.submit([i]) for i in range(4)]
        assert [f.result(timeout=5) for f in futures] == [[0], [2], [4], [6]]
        assert all(f.done() for f in futures)
        assert streamer.timeout == 5
        assert streamer.destroy_workers() is None
        with pytest.raises(RuntimeError, match="closed"):
            streamer.predict([1])


def test_streamer_all_ten_positional_arguments():
    streamer = Streamer(Affine, 8, 0.01, 2, None, (3,), {"offset": 1}, True, "spawn", 30)
    try:
        assert streamer.timeout == 30
        assert streamer.predict([1, 2]) == [4, 7]
        streamer._wait_for_worker_ready()  # service-streamer's example/future_example.py calls it
        assert streamer.submit([0]).result(timeout=30) == [1]
    finally:
        streamer.destroy_workers()
    assert [p.exitcode for p in streamer._processes] == [0, 0]


def test_streamer_keywords_and_destroy_workers_stops_every_worker_cleanly():
    # One stop signal per worker: a worker that took several left the others waiting for theirs
    # until worker_timeout ran out, then they were terminated (exit code -SIGTERM).
    streamer = Streamer(
        predict_function_or_model=Affine, batch_size=8, max_latency=0.01, worker_num=3, cuda_devices=None,
        model_init_args=None, model_init_kwargs={"scale": 2}, wait_for_worker_ready=False,
        mp_start_method="spawn", worker_timeout=10,
    )
    streamer._wait_for_worker_ready(120)
    assert streamer.predict([1, 2, 3]) == [2, 4, 6]
    streamer.destroy_workers()
    assert [p.exitcode for p in streamer._processes] == [0, 0, 0]


def test_managed_model_positional_and_keyword_gpu_id():
    assert Affine(None).gpu_id is None
    assert Affine(gpu_id=None).gpu_id is None
    ManagedModel.set_gpu_id(None)
    model = Affine()
    model.init_model(2, offset=1)
    assert model.predict([1, 2]) == [3, 5]


def test_redis_streamer_host_port_and_keyword_forms(redis_url, prefix, workers):
    workers.start(prefix)
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]  # service-streamer's "localhost:6379" form
    for streamer in (RedisStreamer(host_port, prefix), RedisStreamer(redis_broker=redis_url, prefix=prefix)):
        try:
            assert streamer.predict([1, 2]) == [2, 4]
            assert streamer.submit([3]).result(timeout=10) == [6]
            with pytest.raises(NotImplementedError):
                streamer.destroy_workers()  # its workers run apart: service-streamer raised too
        finally:
            streamer.close()


def test_redis_worker_keyword_form(redis_url, prefix):
    worker = RedisWorker(model_class=Doubler, batch_size=4, max_latency=0.01, redis_broker=redis_url, prefix=prefix,
                         model_init_args=None, model_init_kwargs={"delay": 0})
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        with RedisStreamer(redis_url, prefix) as streamer:
            wait_for_workers(redis_url, prefix, pids={os.getpid()})
            assert streamer.predict([5], timeout=10) == [10]
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


DAEMON_THREAD_SCRIPT = """
    import sys
    import threading

    from rstreamer import RedisStreamer, run_redis_workers_forever
    from support.models import Affine
    from support.procs import live_pids, wait_for_workers

    if __name__ == "__main__":
        url, prefix = sys.argv[1], sys.argv[2]
        threading.Thread(target=run_redis_workers_forever, daemon=True, args=(
            Affine, 4, 0.01, 1, None, url, prefix + "-pos", "spawn", (3,), {"offset": 1})).start()
        threading.Thread(target=run_redis_workers_forever, daemon=True, kwargs=dict(
            model_class=Affine, batch_size=4, max_latency=0.01, worker_num=2, cuda_devices=None, redis_broker=url,
            prefix=prefix + "-kw", mp_start_method="spawn", model_init_args=(5,), model_init_kwargs={"offset": 2},
        )).start()
        for suffix, count in (("-pos", 1), ("-kw", 2)):
            wait_for_workers(url, prefix + suffix, count=count, timeout=120)
            print(RedisStreamer(url, prefix + suffix).predict([1, 2], timeout=30), flush=True)
        print(*live_pids(url, prefix + "-pos") | live_pids(url, prefix + "-kw"), flush=True)
    # the main thread ends here, with the workers' daemon threads still running
"""


def _run_script(directory: Path, source: str, *args: str) -> subprocess.Popen[str]:
    path = directory / "script.py"
    path.write_text(textwrap.dedent(source))
    return subprocess.Popen([sys.executable, str(path), *args], cwd=directory, env=child_env(), text=True,
                            stdout=subprocess.PIPE, start_new_session=True)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    stop_group(proc)
    if proc.stdout is not None:
        proc.stdout.close()


def test_run_redis_workers_forever_in_a_daemon_thread_lets_the_process_exit(redis_url, prefix, tmp_path):
    proc = _run_script(tmp_path, DAEMON_THREAD_SCRIPT, redis_url, prefix)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "[4, 7]"  # positional: (3,) scale, offset 1
        assert proc.stdout.readline().strip() == "[7, 12]"  # keywords: (5,) scale, offset 2
        pids = {int(pid) for pid in proc.stdout.readline().split()}
        assert len(pids) == 3
        # service-streamer's exits in under a second; before the fix this process never exited.
        assert proc.wait(timeout=30) == 0
    finally:
        _kill_group(proc)
    wait_until(lambda: not any(_alive(pid) for pid in pids), 10, what="worker processes gone")
    assert not live_pids(redis_url, prefix + "-pos") | live_pids(redis_url, prefix + "-kw")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


GEVENT_FLASK_SCRIPT = """
    import sys

    from flask import Flask, jsonify, request
    from gevent import monkey; monkey.patch_all()
    from gevent.pywsgi import WSGIServer

    from rstreamer import Streamer
    from support.models import Doubler

    app = Flask(__name__)
    streamer = None


    @app.route("/stream", methods=["POST"])
    def stream_predict():
        return jsonify(streamer.predict(request.form.getlist("s")))


    if __name__ == "__main__":
        streamer = Streamer(Doubler, batch_size=8, max_latency=0.05, worker_num=2)
        WSGIServer(("127.0.0.1", int(sys.argv[1])), app, log=None).serve_forever()
"""


@contextlib.contextmanager
def _gevent_app(tmp_path: Path) -> Iterator[Callable[[list[str]], list[str]]]:
    """The gevent Flask app of GEVENT_FLASK_SCRIPT, answering; yields a poster."""
    port = free_port()
    proc = _run_script(tmp_path, GEVENT_FLASK_SCRIPT, str(port))
    url = f"http://127.0.0.1:{port}/stream"

    def post(texts: list[str]) -> list[str]:
        response = httpx.post(url, data={"s": texts}, timeout=30)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def answers() -> bool:
        assert proc.poll() is None, "the app exited"
        try:
            return post(["ab"]) == ["abab"]
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, 120, interval=0.2, what="the gevent app answers")
        yield post
    finally:
        _kill_group(proc)


def test_a_gevent_app_with_a_multi_process_streamer_starts_and_answers(tmp_path):
    # service-streamer's example/flask_multigpu_example.py: before the fix, Streamer never
    # finished constructing after monkey.patch_all(), so the server never listened.
    with _gevent_app(tmp_path) as post:
        assert post(["cd"]) == ["cdcd"]


def test_flask_app_with_a_multi_process_streamer_under_gevent(tmp_path):
    # Spawned workers re-run the app's monkey.patch_all(); before the fix their answers went
    # through a feeder greenlet that ran only when the worker yielded, so 2-item calls took
    # 0.5-5 s and sometimes lost an answer (20 s timeout).
    with _gevent_app(tmp_path) as post:
        assert [post([f"x{i}", "y"]) for i in range(16)] == [[f"x{i}x{i}", "yy"] for i in range(16)]


def test_concurrent_requests_to_a_gevent_app_with_a_multi_process_streamer(tmp_path):
    with _gevent_app(tmp_path) as post, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: post([f"x{i}", "y"]), range(64)))
        assert results == [[f"x{i}x{i}", "yy"] for i in range(64)]


ORPHAN_SCRIPT = """
    import sys

    from rstreamer import Streamer
    from support.models import Doubler

    if __name__ == "__main__":
        streamer = Streamer(Doubler, 8, 0.05, worker_num=2, wait_for_worker_ready=True)
        print(streamer.predict(["a"]), flush=True)
        print(" ".join(str(p.pid) for p in streamer._processes), flush=True)
        sys.stdin.read()  # until killed
"""


def test_local_workers_exit_when_the_process_that_owns_them_is_killed(tmp_path):
    # A web process SIGKILLed (or SIGTERMed without close()) never sends the stop signals; its
    # workers used to wait on the inbox for ever, orphans.
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(ORPHAN_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=child_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "['aa']"
        pids = {int(pid) for pid in proc.stdout.readline().split()}
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: not any(_alive(pid) for pid in pids), 10, what="the orphaned workers to exit")
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
