"""Small real models for the tests (importable by worker processes via PYTHONPATH)."""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from rstreamer import GenerativeModel, InvalidInput, ManagedModel, Step


def double(batch: list[Any]) -> list[Any]:
    return [item * 2 for item in batch]


def megabytes(batch: list[Any]) -> list[bytes]:
    """An answer of 1 MiB per item, a little slowly: a parent's pipe fills while it does not read."""
    time.sleep(0.02)
    return [bytes(1 << 20) for _ in batch]


class Doubler(ManagedModel):
    """x -> 2x; 'boom' raises; 'kill' kills the process; ('sleep', s) sleeps s seconds;
    ('wait_for', path) waits (up to 60 s) until a file is at that path."""

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        self.delay = float(kwargs.get("delay", 0.0))

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs = []
        for item in batch:
            if isinstance(item, str) and item == "boom":
                raise ValueError("boom is not a number")
            if isinstance(item, str) and item == "kill":
                os._exit(17)
            if isinstance(item, list) and item[:1] == ["sleep"]:
                time.sleep(float(item[1]))
                outputs.append("slept")
                continue
            if isinstance(item, list) and item[:1] == ["wait_for"]:
                outputs.append(_wait_for_file(item[1]))
                continue
            outputs.append(item * 2)
        if self.delay:
            time.sleep(self.delay)
        return outputs


def _wait_for_file(path: str, timeout: float = 60.0) -> str:
    """'waited' once a file is at ``path`` (a test's gate), 'gate timed out' after ``timeout`` s;
    ``path`` + '.entered' is created when the wait starts (the batch is running)."""
    open(path + ".entered", "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return "gate timed out"
        time.sleep(0.005)
    return "waited"


class WrongLength(ManagedModel):
    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch[:-1]


class Placement(ManagedModel):
    """Reports where it was placed."""

    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_id": self.gpu_id, "pid": os.getpid()}
                for _ in batch]


class BrokenInit(ManagedModel):
    def init_model(self) -> None:
        raise RuntimeError("weights not found")


class LoadsOnce(ManagedModel):
    """Loads the first time (and its process then dies after ``die_after`` s); every later
    init_model fails, as a model whose GPU broke after it had loaded. ``marker``: a file it creates."""

    def init_model(self, marker: str, die_after: float = 0.5) -> None:
        if os.path.exists(marker):
            raise RuntimeError("weights not found")
        open(marker, "w").close()
        threading.Timer(die_after, os._exit, args=(17,)).start()

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class Picky(ManagedModel):
    """x -> 2x for an int; anything else is refused with InvalidInput."""

    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        for item in batch:
            if not isinstance(item, int):
                raise InvalidInput(f"expected an int, got {type(item).__name__}")
        return [item * 2 for item in batch]


class SlowToFail(ManagedModel):
    """Logs each batch it is given (one JSON line to ``log``, at the start of the call), takes
    ``delay`` seconds, then raises if the batch holds "boom", else doubles: a failing batch whose
    halves a worker would run one after the other."""

    def init_model(self, log: str, delay: float = 1.0) -> None:
        self.log = log
        self.delay = delay

    def predict(self, batch: list[Any]) -> list[Any]:
        with open(self.log, "a") as out:
            out.write(json.dumps(batch) + "\n")
        time.sleep(self.delay)
        if "boom" in batch:
            raise ValueError("boom is not a number")
        return [item * 2 for item in batch]


class Recorder(ManagedModel):
    """Doubler that appends every item it runs to a file, to count executions."""

    def init_model(self, path: str, delay: float = 0.0) -> None:
        self.path = path
        self.delay = delay
        self.inner = Doubler()
        self.inner.init_model()

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs = self.inner.predict(batch)
        if self.delay:
            time.sleep(self.delay)
        with open(self.path, "a") as log:
            log.write("".join(f"{item!r}\n" for item in batch))
        return outputs


def echo_outputs(batch: list[Any]) -> list[Any]:
    """Echo; 'tuple-key' answers 8.4 M zeros: they encode (8 MB) but hold more objects than a client
    decodes (64 MiB / 8). (A dict with a tuple key was the example until tuples got a codec.)"""
    return [[0] * 8_400_000 if item == "tuple-key" else item for item in batch]


class Affine(ManagedModel):
    """x -> x * scale + offset: shows which init args and kwargs reached the model."""

    def init_model(self, scale: int = 1, offset: int = 0) -> None:
        self.scale, self.offset = scale, offset

    def predict(self, batch: list[Any]) -> list[Any]:
        return [item * self.scale + self.offset for item in batch]


def length(batch: list[Any]) -> list[Any]:
    """A small answer for any input: its length."""
    return [len(item) for item in batch]


class BatchRecorder(ManagedModel):
    """Doubler that appends each batch it runs, as one line, to a file."""

    def init_model(self, path: str, delay: float = 0.0) -> None:
        self.path = path
        self.delay = delay

    def predict(self, batch: list[Any]) -> list[Any]:
        with open(self.path, "a") as log:
            log.write(f"{os.getpid()} {batch!r}\n")
        if self.delay:
            time.sleep(self.delay)
        return [item * 2 for item in batch]


class GilHog(ManagedModel):
    """Each item is a number of seconds spent in one C call that never releases the GIL; every
    run is appended to a file."""

    def init_model(self, path: str) -> None:
        self.path = path
        started = time.perf_counter()
        sum(range(2_000_000))
        self.per_step = max(time.perf_counter() - started, 1e-6) / 2_000_000

    def predict(self, batch: list[Any]) -> list[Any]:
        with open(self.path, "a") as log:
            log.write(f"{os.getpid()} {batch!r}\n")
        for seconds in batch:
            sum(range(int(seconds / self.per_step)))  # holds the GIL throughout
        return batch


class HangOnce(ManagedModel):
    """The first process to run an item hangs (as a deadlocked model would); later runs answer."""

    def init_model(self, marker: str) -> None:
        self.marker = marker

    def predict(self, batch: list[Any]) -> list[Any]:
        try:
            with open(self.marker, "x"):
                pass
        except FileExistsError:
            return [item * 2 for item in batch]
        time.sleep(3600)
        return []


class SimulatedOutOfMemory(Exception):
    """What a device out of memory raises in the tests (named in TokenModel.oom_errors)."""


class TokenModel(ManagedModel):
    """Items are strings; an item costs its length. Answers each item with ``[its length, the
    padded cost of its batch, the batch's size]``, so a test sees every batch the model ran.
    Above ``oom_above`` padded tokens it raises SimulatedOutOfMemory, a limit it never tells
    the worker; ``delay`` seconds per batch; an item "kill" ends the process."""

    oom_errors = (SimulatedOutOfMemory,)

    def init_model(self, oom_above: int | None = None, delay: float = 0.0) -> None:
        self.oom_above = oom_above
        self.delay = delay

    def cost(self, item: Any) -> int:
        return max(1, len(item))

    def predict(self, batch: list[Any]) -> list[Any]:
        if "kill" in batch:
            os._exit(17)
        padded = len(batch) * max(len(item) for item in batch)
        if self.oom_above is not None and padded > self.oom_above:
            raise SimulatedOutOfMemory(f"a batch of {padded} padded tokens is over {self.oom_above}")
        if self.delay:
            time.sleep(self.delay)
        return [[len(item), padded, len(batch)] for item in batch]


class Ticker(GenerativeModel):
    """Item ``{"n": steps, "fail_at": k}`` yields ``[i, live]`` at step i (live: sequences live at
    that step) for n steps; a step raises once any live item reaches its ``fail_at``; an item
    that is not a dict is refused at start. ``delay`` seconds per step; ``sampling`` makes the
    model non-deterministic; ``kill_at``: the process dies when any item reaches that step;
    ``log``: a file where every item started is written, one ``repr`` a line; ``tag``, appended to
    every chunk (``[i, live, tag]``): two workers with different tags claim to be deterministic but
    answer differently, as batched float arithmetic can make a greedy model do."""

    def init_model(self, delay: float = 0.0, sampling: bool = False, kill_at: int | None = None,
                   log: str | None = None, tag: Any = None) -> None:
        self.delay = delay
        self.deterministic = not sampling
        self.kill_at = kill_at
        self.log = log
        self.tag = tag
        self.live: dict[int, list[Any]] = {}

    def start(self, items: Mapping[int, Any]) -> None:
        if not all(isinstance(item, dict) and isinstance(item.get("n"), int) for item in items.values()):
            raise TypeError('a Ticker item is {"n": int}')
        if self.log:
            with open(self.log, "a") as log:
                log.writelines(f"{item!r}\n" for item in items.values())
        for key, item in items.items():
            self.live[key] = [item, 0]

    def step(self) -> dict[int, Step]:
        if self.delay:
            time.sleep(self.delay)
        out = {}
        for key, (item, done) in list(self.live.items()):
            if item.get("fail_at") == done:
                raise ValueError(f"failed at step {done}")
            if self.kill_at == done:
                os._exit(17)
            self.live[key][1] = done + 1
            finished = done + 1 >= item["n"]
            chunk = [done, len(self.live)] if self.tag is None else [done, len(self.live), self.tag]
            out[key] = Step([chunk], finished)
            if finished:
                del self.live[key]
        return out

    def cancel(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.live.pop(key, None)


class Tagged(ManagedModel):
    """A shelf's model: answers each item with ``[tag, pid, 2 * item]``, so a test sees which model
    and which process served it. ``load_delay``: seconds init_model takes (a real load cost);
    ``log``: a file where every item run is appended as ``tag pid item``; ``fail``: init_model raises."""

    def init_model(self, tag: str, load_delay: float = 0.0, log: str | None = None, fail: bool = False,
                   delay: float = 0.0) -> None:
        time.sleep(load_delay)
        if fail:
            raise FileNotFoundError(f"no weights for {tag}")
        self.tag, self.log, self.delay = tag, log, delay

    def predict(self, batch: list[Any]) -> list[Any]:
        if self.delay:
            time.sleep(self.delay)
        if self.log:
            with open(self.log, "a") as log:
                log.write("".join(f"{self.tag} {os.getpid()} {item!r}\n" for item in batch))
        return [[self.tag, os.getpid(), item * 2] for item in batch]


class CountedTagged(Tagged):
    """Tagged, answering ``[tag, models of this class alive in the process, 2 * item]``, counted
    without a collection: an evicted model must be gone by then, not left to the garbage collector."""

    alive: ClassVar[weakref.WeakSet[CountedTagged]] = weakref.WeakSet()

    def init_model(self, tag: str, load_delay: float = 0.0, log: str | None = None, fail: bool = False,
                   delay: float = 0.0) -> None:
        super().init_model(tag, load_delay, log, fail, delay)
        CountedTagged.alive.add(self)

    def predict(self, batch: list[Any]) -> list[Any]:
        return [[self.tag, len(CountedTagged.alive), item * 2] for item in batch]


class CostedTagged(Tagged):
    """Tagged with a cost per item (1 to 4): its worker batches by cost and holds items read ahead."""

    def cost(self, item: Any) -> int:
        return 1 + int(item) % 4


class TextLengths(ManagedModel):
    """A tiny embedding model: each text becomes ``[its length, 1.0]`` (for the OpenAI embeddings route)."""

    def init_model(self, load_delay: float = 0.0) -> None:
        time.sleep(load_delay)

    def predict(self, batch: list[Any]) -> list[Any]:
        return [[float(len(text)), 1.0] for text in batch]
