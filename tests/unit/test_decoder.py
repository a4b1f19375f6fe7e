"""Unit tests of workers.decoder (the small causal decoder with a KV cache): determinism,
independence from the other live sequences, the item contract, and the request-level baseline."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from rstreamer.batching.scheduler import Scheduler
from workers.decoder import RequestLevelDecoder, TinyDecoder

SMALL: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 2, "max_context": 96}


def decoder(**kwargs: Any) -> TinyDecoder:
    model = TinyDecoder()
    model.init_model(**{**SMALL, **kwargs})
    return model


def generate(model: TinyDecoder, items: list[dict[str, Any]], max_active: int = 64) -> list[str]:
    scheduler: Scheduler[int] = Scheduler(model, max_active)
    for n, item in enumerate(items):
        scheduler.offer(n, item, deadline=1e18)
    texts = [""] * len(items)
    while not scheduler.idle:
        assert scheduler.admit(0) == []
        for event in scheduler.step():
            texts[event.item] += "".join(chunk for _, chunk in event.chunks)
    return texts


def test_greedy_decoding_is_deterministic_across_processes_and_batch_mates() -> None:
    item = {"prompt": "the quick brown fox", "max_new_tokens": 30}
    alone = generate(decoder(), [item])[0]
    assert len(alone) == 30
    # Same weights in a fresh model (fixed seed), and the same text whoever else is live,
    # whenever they join: what a restarted item relies on to resume by sequence number.
    others = [{"prompt": f"p{n}" * n, "max_new_tokens": 5 + 3 * n} for n in range(12)]
    mixed = generate(decoder(), [*others[:6], item, *others[6:]], max_active=5)
    assert mixed[6] == alone
    assert generate(decoder(), others, max_active=3) == generate(decoder(), others, max_active=12)


def test_each_item_gets_max_new_tokens_chunks() -> None:
    items = [{"prompt": "a", "max_new_tokens": n} for n in (1, 4, 9)]
    assert [len(text) for text in generate(decoder(), items, max_active=2)] == [1, 4, 9]


def test_bad_items_are_refused_with_a_reason() -> None:
    model = decoder()
    for item, reason in [("text", "an item is"), ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
                         ({"prompt": "a" * 90, "max_new_tokens": 20}, "exceed the context")]:
        with pytest.raises((TypeError, ValueError), match=reason):
            model.start({0: item})
    assert model.sequences == {}


def test_cancel_frees_the_cache_slot_and_the_cache_grows() -> None:
    model = decoder()
    model.start({n: {"prompt": "ab", "max_new_tokens": 50} for n in range(20)})  # more than the 8 first slots
    assert len(model.sequences) == 20 and model.k_cache.shape[1] == 32
    model.step()
    model.cancel(list(range(0, 20, 3)))
    # The live sequences keep the first slots (their cache is a view in each step).
    assert sorted(seq.slot for seq in model.sequences.values()) == list(range(13))
    model.cancel(list(range(20)))
    assert model.sequences == {}


def test_sampling_is_not_deterministic() -> None:
    model = decoder(sampling=True)
    assert model.deterministic is False
    texts = generate(model, [{"prompt": "x", "max_new_tokens": 40}] * 2)
    assert texts[0] != texts[1]


def test_request_level_baseline_answers_the_same_text() -> None:
    items = [{"prompt": "hello", "max_new_tokens": 3}, {"prompt": "world", "max_new_tokens": 11}]
    baseline = RequestLevelDecoder()
    baseline.init_model(**SMALL)
    assert baseline.predict(items) == generate(decoder(), items)


def test_cost_is_the_kv_cache_an_item_needs() -> None:
    model = decoder()
    assert model.cost({"prompt": "abc", "max_new_tokens": 10}) == 14  # BOS + 3 + 10
    assert model.cost("not an item") == 1
