"""What every streamer shares: predict on top of submit, close, context manager."""
from __future__ import annotations

import abc
from typing import Any, TypeVar

from .future import Future

_Streamer = TypeVar("_Streamer", bound="BaseStreamer")


class BaseStreamer(abc.ABC):
    """The streamer API: ``submit(batch) -> Future`` and ``predict(batch) -> list``."""

    @abc.abstractmethod
    def submit(self, batch: list[Any], timeout: float | None = None) -> Future:
        """Queue ``batch``; the Future's ``result()`` returns one output per item."""

    def predict(self, batch: list[Any], timeout: float | None = None) -> list[Any]:
        """Return one output per item of ``batch``, in order (blocks until answered)."""
        return self.submit(batch, timeout).result()

    def close(self) -> None:  # noqa: B027  (a no-op unless the transport holds resources)
        """Release the streamer's resources; calls made after it fail."""

    def destroy_workers(self) -> None:
        """Stop the workers this streamer started (service-streamer's API).

        Raises:
            NotImplementedError: this streamer started no workers (the Redis transport, whose
                workers run apart from it); call :meth:`close` to release the streamer itself.
        """
        raise NotImplementedError(f"{type(self).__name__} starts no workers; call close() to release it")

    def __enter__(self: _Streamer) -> _Streamer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
