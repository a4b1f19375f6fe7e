"""The Future a ``submit`` returns: one answer per index, the first one wins."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..batching.batcher import Failure, Outcome
from ..broker.deadline import Deadline
from ..errors import Cancelled, StreamerTimeout, remote_error_from
from ..ops.hooks import caller_woken
from .core import Call

if TYPE_CHECKING:
    from .coalescer import Ticket


class BaseFuture:
    """Answers of one ``submit(batch)`` call; how to wait for them is up to the subclass.

    ``deadline``: the call's, when the call has one already (a :class:`~rstreamer.client.core.Call`'s);
    by default ``timeout`` seconds from now.
    """

    def __init__(self, size: int, timeout: float, deadline: Deadline | None = None) -> None:
        self.size = size
        self.timeout = timeout
        self._deadline = deadline or Deadline.after(timeout)
        self._outcomes: dict[int, Outcome[Any]] = {}
        self._error: BaseException | None = None
        self._cancelled = False
        # Indexes of the items a worker already held when the call was withdrawn (they may have
        # run); the others were deleted before any worker read them. Filled by the transport.
        self.held: set[int] = set()
        self._cancel_callback: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.answered_at: float | None = None

    @property
    def deadline(self) -> float:
        """The call's deadline on the epoch clock (what travels with its items)."""
        return self._deadline.at

    @property
    def expires_at(self) -> float:
        """The call's deadline on this process's monotonic clock."""
        return self._deadline.expires_at

    def deliver(self, index: int, outcome: Outcome[Any]) -> None:
        """Record the answer of item ``index``; the first answer per index wins."""
        with self._lock:
            if 0 <= index < self.size and index not in self._outcomes and not self._cancelled:
                self._outcomes[index] = outcome
                if len(self._outcomes) == self.size:
                    self.answered_at = time.perf_counter()  # for rstreamer_client_wakeup_seconds
                    self.let_go()
                    self._on_complete()

    def fail(self, error: BaseException) -> None:
        """End the call with ``error`` (it was not enqueued, or its answers cannot be read)."""
        with self._lock:
            if not self.settled():
                self._error = error
                self.let_go()
                self._on_complete()

    def _on_complete(self) -> None:
        """Called, under the lock, when the last answer arrives or the call fails."""

    def let_go(self) -> None:
        """Let go of the transport (the cancel callback; a subclass's ticket): called once the call
        is answered or failed, when cancel() withdraws nothing any more, and by the transport once
        it is done with the call (its answers popped, or withdrawn past its deadline). Those links
        and the ticket's own link back to the future closed a reference cycle per call, which
        left every call's objects to the garbage collector: 12 of the 85 us of client CPU per
        item with 64 caller threads (issue 26)."""
        self._cancel_callback = None

    def cancel(self) -> bool:
        """Withdraw the call: waiting ends with Cancelled, answers that still come are dropped,
        and over Redis its items that no worker has read are deleted, so none of them runs
        (see :mod:`rstreamer.wire.cancel`). False when it was already answered or failed."""
        with self._lock:
            if self.settled():
                return False
            self._error = Cancelled(f"the call of {self.size} items was cancelled")
            self._cancelled = True
            self._on_complete()
        self._on_cancel()
        return True

    def cancelled(self) -> bool:
        """True if :meth:`cancel` withdrew the call."""
        return self._cancelled

    def answered(self, index: int) -> bool:
        """True once item ``index`` has its answer."""
        return index in self._outcomes

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called (once, outside the lock) when the call is cancelled: the
        transport withdraws its items."""
        self._cancel_callback = callback

    def _on_cancel(self) -> None:
        if self._cancel_callback is not None:
            self._cancel_callback()

    def deliver_all(self, results: Iterable[tuple[int, Outcome[Any]]]) -> None:
        """Record several answers (see :meth:`deliver`)."""
        for index, outcome in results:
            self.deliver(index, outcome)

    def done(self) -> bool:
        """True once every item has an answer."""
        return len(self._outcomes) == self.size

    def settled(self) -> bool:
        """True once every item has an answer or the call has failed."""
        return self._error is not None or self.done()

    def _until(self, timeout: float | None) -> float:
        """The monotonic time a wait of ``timeout`` seconds ends: never after the call's deadline."""
        return self._deadline.wait_until(timeout)

    def _past_deadline(self) -> bool:
        return self._deadline.expired()

    def _timeout_error(self) -> StreamerTimeout:
        missing = self.size - len(self._outcomes)
        if self._past_deadline():
            return StreamerTimeout(
                f"{missing} of {self.size} items unanswered after the call's {self.timeout:g}s timeout"
            )
        return StreamerTimeout(f"{missing} of {self.size} items not answered yet")

    def _values(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        values = []
        for index in range(self.size):
            outcome = self._outcomes[index]
            if not outcome.ok:
                failure = outcome.failure or Failure("Error", "unknown failure")
                raise remote_error_from(failure.type, failure.message, failure.kind, index)
            values.append(outcome.value)
        return values


class Future(BaseFuture):
    """Outputs of one ``submit(batch)`` call, in the order of the batch."""

    def __init__(self, size: int, timeout: float, deadline: Deadline | None = None) -> None:
        super().__init__(size, timeout, deadline)
        # Held until the call settles: a wait is one acquire (a Condition cost every call a
        # waiter lock, a deque and two more trips through the future's lock; issue 26).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._open = False
        if size == 0:  # nothing to answer, so nothing will settle it: settled now
            self._on_complete()

    def _on_complete(self) -> None:
        if not self._open:  # a call settles once, but deliver() may still complete it after fail()
            self._open = True
            self._gate.release()

    def _wait_until(self, until: float) -> bool:
        """Wait until every item is answered or the monotonic time ``until``."""
        if self._gate.acquire(timeout=max(0.0, until - time.monotonic())):
            self._gate.release()  # open for every other waiter
            return True
        return self.settled()

    def _expired(self) -> None:
        """Called once the call's deadline has passed without all answers."""

    def result(self, timeout: float | None = None) -> list[Any]:
        """The outputs, in order; raises the error of the first failed item.

        Raises StreamerTimeout when ``timeout`` (or the call's own deadline, whichever is
        sooner) passes first.
        """
        if not self._wait_until(self._until(timeout)):
            if self._past_deadline():
                self._expired()
            raise self._timeout_error()
        caller_woken(self.answered_at)
        return self._values()


class RedisFuture(Future):
    """A Future answered by the streamer's I/O threads (see :mod:`rstreamer.client.coalescer`)."""

    def __init__(self, call: Call) -> None:
        super().__init__(len(call.payloads), call.timeout, call.deadline)
        self.call = call
        self.ticket: Ticket | None = None  # its place in the coalescer, once enqueued, until settled

    def let_go(self) -> None:
        """Let go of the cancel callback and of the ticket."""
        super().let_go()
        self.ticket = None
