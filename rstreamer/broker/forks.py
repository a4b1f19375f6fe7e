"""State that a forked child must not inherit from its parent's other threads.

A fork keeps only the thread that called it (POSIX): the parent's other threads are gone in the
child, but what they were doing stays in its memory (a call half sent, a flag saying a flusher or
a read is running, a lock one of them held). A streamer made before a fork and used in the child
(multiprocessing's fork start method, a pre-fork pool inside a threaded web process) must start
that state afresh there, or its calls wait for a flusher that no longer exists.
"""
from __future__ import annotations

import os
import weakref
from typing import Protocol


class RenewedAfterFork(Protocol):
    """An object with state of its own threads (see the module)."""

    def renew_after_fork(self) -> None:
        """Start afresh in a forked child: new locks, no work of the parent's threads."""


_renewed: weakref.WeakSet[RenewedAfterFork] = weakref.WeakSet()


def renew_after_fork(owner: RenewedAfterFork) -> None:
    """Have ``owner.renew_after_fork()`` called in every child forked while ``owner`` lives."""
    _renewed.add(owner)


def _in_child() -> None:
    for owner in list(_renewed):
        owner.renew_after_fork()


os.register_at_fork(after_in_child=_in_child)
