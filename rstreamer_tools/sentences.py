"""Real sentences with known relations, to check that embeddings carry meaning (the demo and the tests)."""
from __future__ import annotations

import math

# (anchor, paraphrase, unrelated): a sound sentence embedding puts the paraphrase closer.
TRIPLES = (
    ("A man is playing a guitar.", "Someone is strumming an instrument.", "The stock market fell sharply today."),
    ("The cat is sleeping on the sofa.", "A kitten naps on the couch.", "Interest rates rose again this quarter."),
    ("It is raining heavily outside.", "There is a downpour out there.", "She wrote a script to parse the logs."),
    ("How do I cook pasta?", "What is the best way to boil spaghetti?", "The train to Berlin leaves at noon."),
    ("The meeting was moved to Friday.", "They rescheduled the meeting for Friday.", "Penguins live in the south."),
    ("My laptop will not turn on.", "The computer does not start.", "We planted tomatoes in the garden."),
    ("He runs five kilometres every morning.", "Each day he jogs 5 km at dawn.", "The museum opens at nine."),
    ("The flight was delayed by two hours.", "Our plane took off two hours late.", "This soup needs more salt."),
    ("Children are playing football in the park.", "Kids kick a ball around the park.",
     "The contract expires next year."),
    ("The doctor prescribed antibiotics.", "The physician gave her a course of antibiotics.",
     "The band released a new album."),
    ("I forgot my password.", "I cannot remember my login password.", "The river flooded the valley."),
    ("The shop closes at six.", "The store shuts at 6 pm.", "Quantum computers use qubits."),
    ("A woman is slicing an onion.", "Someone is cutting an onion with a knife.", "A plane is landing at night."),
    ("The baby is crying loudly.", "The infant will not stop wailing.", "Bitcoin prices are volatile."),
    ("Please turn off the lights.", "Switch the lamps off, please.", "The election results were announced."),
    ("The car needs new tyres.", "The vehicle's tires must be replaced.", "Bees make honey from nectar."),
    ("She is learning to speak Spanish.", "She studies the Spanish language.", "The bridge was painted red."),
    ("The hotel room was very clean.", "Our room at the hotel was spotless.", "The server crashed overnight."),
    ("Add two cups of flour to the bowl.", "Put 2 cups of flour in the mixing bowl.",
     "The goalkeeper saved a penalty."),
    ("The company hired fifty new engineers.", "Fifty engineers joined the firm.", "The moon orbits the Earth."),
)

SENTENCES = tuple(sentence for triple in TRIPLES for sentence in triple)


def cosine(u: list[float], v: list[float]) -> float:
    """The cosine of two vectors (0 when either is all zeros)."""
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)) or 1.0)
