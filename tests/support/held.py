"""The held first ENQUEUE of the ``held_first_send`` fixture (tests/conftest.py)."""
from __future__ import annotations

import threading

from rstreamer import RedisStreamer
from support.polling import wait_until


class HeldSends(list[int]):
    """The sizes of the ENQUEUE_CALLS sent. The first waits at ``gate`` until the test releases it
    (:meth:`release`, or :meth:`release_when` enough calls wait behind it), never on a timer: on a
    loaded machine a timed hold ends before the calls it was meant for have piled up. ``hold``
    bounds the wait so that a test that forgets to release fails slowly instead of hanging."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.hold = 60.0
        self.error: BaseException | None = None
        self._releaser: threading.Thread | None = None

    def release(self) -> None:
        self.gate.set()

    def release_when(self, streamer: RedisStreamer, waiting: int, callers: int | None = None) -> None:
        """Release the first ENQUEUE, from a thread, once ``waiting`` calls wait behind it, or
        once every one of ``callers`` (a fixed number of caller threads) has its call in it or
        behind it: on a busy machine the first ENQUEUE may take nearly all of them, and no call
        can come after while they wait for their answers."""
        def piled_up() -> bool:
            pending = len(streamer._coalescer._pending)
            return bool(self) and (pending >= waiting or (callers is not None and self[0] + pending >= callers))

        def run() -> None:
            try:
                wait_until(piled_up, timeout=self.hold, what=f"{waiting} calls behind the held ENQUEUE")
            except AssertionError as exc:
                self.error = exc
            finally:
                self.release()

        self._releaser = threading.Thread(target=run, daemon=True)
        self._releaser.start()

    def check(self) -> None:
        """Fail if the calls the test meant to pile up never did."""
        if self._releaser is not None:
            self._releaser.join()
        if self.error is not None:
            raise self.error
