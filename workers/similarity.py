"""Semantic search over a small bundled corpus, and pairwise sentence similarity.

Each item of a batch is one of two forms:

- a query string ``"how do I make pasta"`` ->
  ``{"query": q, "matches": [{"text": str, "score": float}, ...]}``, the ``top_k`` corpus
  sentences (``workers/data/corpus.txt``) closest to the query, best first, scored by cosine;
- a pair ``{"a": str, "b": str}`` -> ``{"similarity": float}``, the cosine of the two sentences.

Anything else, and a text longer than ``max_chars`` (see workers/embedding.py), raises
:class:`~rstreamer.InvalidInput` (HTTP 400). All the strings of a batch are embedded in one
forward pass.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rstreamer.errors import InvalidInput
from workers.embedding import MAX_CHARS, EmbeddingModel, check_text

#: The corpus searched by default: one sentence per line.
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"


def load_corpus(path: str | Path = CORPUS_PATH) -> list[str]:
    """The non-blank lines of ``path``, stripped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def _check_item(item: Any, max_chars: int) -> None:
    if isinstance(item, str):
        check_text(item, max_chars)
        return
    if isinstance(item, dict) and set(item) == {"a", "b"} and all(isinstance(v, str) for v in item.values()):
        check_text(item["a"], max_chars)
        check_text(item["b"], max_chars)
        return
    raise InvalidInput(f"expected a query str or {{'a': str, 'b': str}}, got {type(item).__name__}"
                       + (f" with keys {sorted(map(str, item))}" if isinstance(item, dict) else ""))


class SimilarityModel(EmbeddingModel):
    """Top-k semantic search over a bundled corpus (str items) and pairwise cosine ({"a", "b"} items)."""

    def init_model(self, device: str | None = None, torch_threads: int | None = None,
                   max_chars: int = MAX_CHARS, *, top_k: int = 3, corpus: str | Path | None = None) -> None:
        """Load the encoder and embed the corpus (``corpus`` file, default the bundled one) once."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        super().init_model(device=device, torch_threads=torch_threads, max_chars=max_chars)
        self.corpus = load_corpus(corpus if corpus is not None else CORPUS_PATH)
        if not self.corpus:
            raise ValueError("the corpus is empty")
        self.top_k = min(top_k, len(self.corpus))
        self.corpus_embeddings = self.encode(self.corpus)

    def predict(self, batch: list[Any]) -> list[dict[str, Any]]:
        """One result per item, in order: matches for a query str, a similarity for an {"a", "b"} pair."""
        import torch

        # Validate the whole batch before any model work, so a bad item fails fast and cheaply.
        for item in batch:
            _check_item(item, self.max_chars)
        texts: list[str] = []
        for item in batch:
            texts.extend([item] if isinstance(item, str) else [item["a"], item["b"]])
        emb = self.encode(texts)

        out: list[dict[str, Any]] = []
        row = 0
        with torch.inference_mode():
            for item in batch:
                if isinstance(item, str):
                    # Embeddings are normalized, so the dot product is the cosine.
                    scores, idx = torch.topk(self.corpus_embeddings @ emb[row], self.top_k)
                    out.append({"query": item, "matches": [
                        {"text": self.corpus[j], "score": s}
                        for s, j in zip(scores.tolist(), idx.tolist(), strict=True)]})
                    row += 1
                else:
                    out.append({"similarity": float(emb[row] @ emb[row + 1])})
                    row += 2
        return out
