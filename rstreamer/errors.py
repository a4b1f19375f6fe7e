"""The rstreamer exception tree.

Every error a caller can see derives from :class:`RStreamerError`; ``http_status`` is the
status a web front end should answer with.
"""
from __future__ import annotations

from enum import Enum


class FailureKind(str, Enum):
    """Why an item has no output; its value is the string that crosses the wire."""

    REMOTE = "remote"  # the model, or the codec, raised: RemoteError
    TIMEOUT = "timeout"  # the call's deadline passed before the item ran: StreamerTimeout
    MISMATCH = "mismatch"  # the model returned a wrong number of outputs: BatchSizeMismatch
    DEAD = "dead"  # delivered too often, or unreadable: DeadLettered
    INVALID = "invalid"  # the model refused the input (it raised InvalidInput): InvalidInput

    @classmethod
    def from_wire(cls, text: object) -> FailureKind:
        """The kind a peer sent; one this version does not know reads as REMOTE."""
        try:
            return cls(text)
        except ValueError:
            return cls.REMOTE


class RStreamerError(Exception):
    """Base class of every rstreamer error."""

    http_status = 500


class ConfigError(RStreamerError, ValueError):
    """A setting is missing or out of range."""


class CodecError(RStreamerError):
    """A value could not be encoded or decoded."""

    http_status = 400


class EncodeError(CodecError, TypeError):
    """A value cannot cross the broker (unsupported type, object dtype, too large)."""


class DecodeError(CodecError, ValueError):
    """Bytes from the broker are not a valid rstreamer message."""


class StreamerTimeout(RStreamerError, TimeoutError):
    """The call's deadline passed before every item was answered."""

    http_status = 504


class Overloaded(RStreamerError):
    """The queue of this endpoint is full; retry later."""

    http_status = 503


class CallTooLarge(RStreamerError, ValueError):
    """One call holds more items than the queue may ever hold (``max_queue``) or than its
    tenant's burst: split it.

    Retrying cannot help, unlike :class:`Overloaded`, hence 413 and not 503.
    """

    http_status = 413


class NoLiveWorker(RStreamerError):
    """No live worker has served the prefix for a while: the call would only wait for its timeout."""

    http_status = 503


class Cancelled(RStreamerError):
    """The call was cancelled (``future.cancel()``, a cancelled task, a client that disconnected)."""

    http_status = 499  # nginx's "client closed request": nobody is left to read it


class RateLimited(RStreamerError):
    """The call's tenant is over its quota; ``retry_after``: seconds until it may send this call
    (a call larger than the tenant's burst never fits: that is :class:`CallTooLarge`)."""

    http_status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after)  # both in args: a copy (type(e)(*e.args)) keeps them
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


class InvalidPriority(RStreamerError, ValueError):
    """The call's priority level is not one the workers of its prefix serve."""

    http_status = 400


class BrokerUnavailable(RStreamerError, ConnectionError):
    """Redis could not be reached within the retry budget."""

    http_status = 503


class RemoteError(RStreamerError):
    """The model raised while predicting this item.

    ``remote_type`` and ``remote_message`` carry the original exception's type name and
    message; the traceback stays in the worker's log. ``index``: the failed item's position in
    the caller's batch (None when unknown), which the message names: the model saw the item in a
    batch of its own making, so an index in the model's own message means nothing to the caller.
    """

    def __init__(self, remote_type: str, remote_message: str, index: int | None = None) -> None:
        super().__init__(remote_type, remote_message, index)  # all in args: a copy keeps them
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.index = index

    def __str__(self) -> str:
        where = f"input {self.index}: " if self.index is not None else ""
        return f"{where}{self.remote_type}: {self.remote_message}"


class BatchSizeMismatch(RemoteError):
    """The model returned a different number of outputs than it was given inputs."""


class DeadLettered(RemoteError):
    """The item was moved to the dead-letter stream (failed too often, or malformed)."""


class InvalidInput(RemoteError, ValueError):
    """An input the model refuses: the wrong type, too long for its window...

    A model raises it from ``predict`` (``raise InvalidInput("expected a str, got int")``) for an
    input that can never succeed: only that item fails (the batch is split to find it, as for any
    exception), the worker logs one line instead of a traceback, and the caller gets this error
    back, naming the input by its index in the caller's batch; the web apps answer 400. The
    message should describe the input, not number it: the model sees batches of its own.
    """

    http_status = 400

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__("InvalidInput", message, index)
        self.args = (message, index)


class JobError(RStreamerError):
    """Base class of the errors of durable jobs (:mod:`rstreamer.jobs`)."""

    http_status = 400


class InvalidJobId(JobError, ValueError):
    """A job id that rstreamer cannot have given (it is 32 lowercase hex digits)."""


class JobNotFound(JobError, LookupError):
    """No job has this id on this prefix: it never existed, expired (its TTL passed) or was purged."""

    http_status = 404


class JobTooLarge(JobError, ValueError):
    """A job with more items than the ``job_max_items`` setting allows."""

    http_status = 413


class JobCancelled(JobError):
    """The job was cancelled before every item was answered; its results are incomplete."""

    http_status = 409


class PrefixInUse(RStreamerError):
    """A prefix that live workers serve cannot be forgotten (``rstreamer forget``)."""

    http_status = 409


class WorkerStartupError(RStreamerError):
    """A local worker process failed to start or load its model."""


def remote_error_from(error_type: str, message: str, kind: str = FailureKind.REMOTE,
                      index: int | None = None) -> RStreamerError:
    """Rebuild the error a worker reported for one item; ``index``: its position in the caller's batch."""
    kind = FailureKind.from_wire(kind)
    if kind is FailureKind.TIMEOUT:
        return StreamerTimeout(message if index is None else f"input {index}: {message}")
    if kind is FailureKind.INVALID:
        return InvalidInput(message, index)
    cls = {FailureKind.MISMATCH: BatchSizeMismatch, FailureKind.DEAD: DeadLettered}.get(kind, RemoteError)
    return cls(error_type, message, index)
