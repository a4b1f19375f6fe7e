"""Which GPU each worker process gets; shared by Streamer, the supervisor and the CLI."""
from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

from ..errors import ConfigError

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
_environ_lock = threading.Lock()

ProcessContext = SpawnContext | ForkContext | ForkServerContext


def process_context(method: str) -> ProcessContext:
    """The multiprocessing context of a start method (spawn, fork or forkserver)."""
    context = multiprocessing.get_context(method)
    if not isinstance(context, (SpawnContext, ForkContext, ForkServerContext)):
        raise ConfigError(f"unknown start method {method!r}")  # get_context raises first; this narrows the type
    return context


def round_robin(worker_num: int, cuda_devices: Sequence[int] | None) -> list[int | None]:
    """service-streamer's placement: worker i on ``cuda_devices[i % len]``; None means CPU."""
    if worker_num < 1:
        raise ConfigError(f"worker_num must be >= 1, got {worker_num}")
    if not cuda_devices:
        return [None] * worker_num
    return [int(cuda_devices[i % len(cuda_devices)]) for i in range(worker_num)]


def per_gpu(gpus: Sequence[int] | None, workers_per_gpu: int) -> list[int | None]:
    """``workers_per_gpu`` slots on each GPU, or that many CPU slots without GPUs."""
    if workers_per_gpu < 1:
        raise ConfigError(f"workers_per_gpu must be >= 1, got {workers_per_gpu}")
    if not gpus:
        return [None] * workers_per_gpu
    return [int(gpu) for gpu in gpus for _ in range(workers_per_gpu)]


def parse_gpus(text: str | None) -> list[int]:
    """``"0,1"`` → ``[0, 1]``; empty → ``[]``."""
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--gpus must be a comma-separated list of integers, got {text!r}") from None


def pin_process_to(gpu_id: int | None) -> None:
    """Make only ``gpu_id`` visible to CUDA in this process; call before importing the model."""
    if gpu_id is not None:
        os.environ[CUDA_VISIBLE_DEVICES] = str(gpu_id)


@contextlib.contextmanager
def child_environment(gpu_id: int | None) -> Iterator[None]:
    """Set ``CUDA_VISIBLE_DEVICES`` for a child process started inside the block.

    A ``spawn`` child inherits the parent's environment, so it has the variable before it
    unpickles its arguments or imports anything (a model class passed by reference would
    otherwise import its module, and maybe torch, before :func:`pin_process_to` runs).
    """
    if gpu_id is None:
        yield
        return
    with _environ_lock:
        saved = os.environ.get(CUDA_VISIBLE_DEVICES)
        os.environ[CUDA_VISIBLE_DEVICES] = str(gpu_id)
        try:
            yield
        finally:
            if saved is None:
                del os.environ[CUDA_VISIBLE_DEVICES]
            else:
                os.environ[CUDA_VISIBLE_DEVICES] = saved


def cuda_device_count(timeout: float = 120.0) -> int | None:
    """How many CUDA devices torch sees on this machine, or None when torch is not installed.

    Asked in a child process: importing torch here would cost the caller seconds and memory,
    and initialising CUDA before forking workers breaks CUDA in them. The child sees every
    device (no CUDA_VISIBLE_DEVICES), as ``--gpus`` ids are physical ids.
    """
    if importlib.util.find_spec("torch") is None:
        return None  # never import torch for a model that does not use it
    env = {name: value for name, value in os.environ.items() if name != CUDA_VISIBLE_DEVICES}
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                              capture_output=True, text=True, timeout=timeout, env=env, check=True)
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None  # torch is broken here; the model's own import will say how


def missing_gpus(gpus: Sequence[int | None], visible: int | None) -> list[int]:
    """The requested GPU ids that are not among the ``visible`` devices (none if unknown)."""
    if visible is None:
        return []
    return sorted({gpu for gpu in gpus if gpu is not None and not 0 <= gpu < visible})
