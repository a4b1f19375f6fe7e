"""Real sentences with known relations, to check that embeddings carry meaning."""
from __future__ import annotations

import math

# Sentence triples: (anchor, paraphrase, unrelated). A sound embedding puts the paraphrase closer.
TRIPLES = [
    ("A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today."),
    ("The cat sleeps on the sofa.", "A kitten is napping on the couch.", "Interest rates rose again this quarter."),
    ("It is raining heavily outside.", "There is a downpour out there.", "She wrote a Python script to parse logs."),
    ("How do I cook pasta?", "What is the way to boil spaghetti?", "The train to Berlin leaves at noon."),
]


def cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))
