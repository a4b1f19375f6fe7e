"""Which GPU each worker process gets; shared by Streamer, the supervisor and the CLI."""
from __future__ import annotations

import os
from collections.abc import Sequence

from .errors import ConfigError


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
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu_id)
