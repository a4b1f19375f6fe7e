"""The Redis server's clock as a worker sees it, so that deadlines never compare host clocks."""
from __future__ import annotations

import time
from collections.abc import Callable


class ServerClock:
    """Redis's time, estimated from this host's monotonic clock and the server's TIME replies.

    Each :meth:`observe` re-anchors the estimate (its error is at most half the round trip), so
    neither this host's wall clock nor a step of it matters. Until the first observation it
    reads this host's wall clock.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self._offset: float | None = None  # server time minus monotonic time, seconds

    def observe(self, server_ms: int, sent: float, received: float) -> None:
        """Record a server time (ms) read between the monotonic times ``sent`` and ``received``."""
        self._offset = server_ms / 1000 - (sent + received) / 2

    def now(self) -> float:
        """Seconds since the epoch on the Redis server's clock."""
        if self._offset is None:
            return self._wall()
        return self._monotonic() + self._offset

    def wall_to_server(self) -> float:
        """Seconds to add to this host's wall clock to get the server's."""
        return self.now() - self._wall()
