"""The one owner of a deadline on the client side: when a call or a wait ends, and what is left of it.

A call's deadline is fixed once, when the call is made (:meth:`Deadline.after`), and read
everywhere from here: on the epoch clock (it travels in the entries, for the workers) and on this
process's monotonic clock (what the caller waits on). A wait that must end with its call, a
blocking read or a retry's pause asks :meth:`Deadline.remaining` or the slices below, never
``time.monotonic()`` arithmetic of its own.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .connection import BLPOP_SLICE, blpop_block, retry_pause

STALL_MARGIN = 0.25
"""Seconds past a deadline a Redis command may take before its caller stops waiting for it (a
stalled Redis answers only at its socket timeout)."""


@dataclass(frozen=True)
class Deadline:
    """When a call or a wait ends. ``timeout`` None: never (``expires_at`` and ``at`` are infinite)."""

    timeout: float | None
    expires_at: float  # on this process's monotonic clock: what callers wait until
    at: float  # on the epoch clock: what travels in the entries

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """The deadline ``timeout`` seconds from now (None: no deadline)."""
        if timeout is None:
            return cls(None, math.inf, math.inf)
        return cls(timeout, time.monotonic() + timeout, time.time() + timeout)

    def shortened(self, timeout: float) -> Deadline:
        """This deadline brought forward to ``timeout`` seconds after its start (never later)."""
        if self.timeout is None:
            return Deadline.after(timeout)
        cut = max(0.0, self.timeout - timeout)
        return Deadline(self.timeout - cut, self.expires_at - cut, self.at - cut)

    @property
    def command_until(self) -> float:
        """The monotonic time a caller stops waiting for a Redis command of this call or wait."""
        return self.expires_at + STALL_MARGIN

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it has passed; infinite for no deadline)."""
        return max(0.0, self.expires_at - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.expires_at

    def wait_until(self, timeout: float | None) -> float:
        """The monotonic time a wait of ``timeout`` seconds ends (None: the deadline): never after the deadline."""
        if timeout is None:
            return self.expires_at
        return min(self.expires_at, time.monotonic() + timeout)

    def blpop_block(self) -> float | None:
        """Seconds the next BLPOP may block (one slice at most); None once the deadline has passed."""
        return blpop_block(self.expires_at)

    def block_ms(self) -> int | None:
        """Milliseconds the next blocking XREAD may wait (one slice at most); None once the deadline has passed."""
        remaining = self.expires_at - time.monotonic()
        if remaining <= 0:
            return None
        return max(1, int(min(remaining, BLPOP_SLICE) * 1000))

    def retry_pause(self, failures: int) -> float | None:
        """Seconds to wait before retrying after ``failures`` broker errors; None to give up."""
        return retry_pause(failures, self.expires_at)
