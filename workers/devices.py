"""Where a worker's torch model runs: the GPU it was placed on, else the CPU."""
from __future__ import annotations


def pick_device(gpu_id: int | None, device: str | None = None) -> str:
    """``device`` if given, else ``"cuda"`` when the worker was placed on a GPU and CUDA works, else ``"cpu"``."""
    if device is not None:
        return device
    import torch

    # CUDA_VISIBLE_DEVICES already names only gpu_id, so the process sees it as its default device.
    if gpu_id is not None and torch.cuda.is_available():
        return "cuda"
    return "cpu"
