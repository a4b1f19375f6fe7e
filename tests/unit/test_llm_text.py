"""Unit tests of workers.llm_text: the chat model's item checks, text deltas that never split a
UTF-8 character nor a stop string, the end of an answer, and per-item sampling (no model: a
byte-level tokenizer stands in for SmolLM2's)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from rstreamer.errors import InvalidInput
from workers.llm_text import (
    ChatRequest,
    Generation,
    Sampler,
    StopFilter,
    TextStream,
    parse_request,
)

END = 256  # the byte tokenizer's end-of-turn token


class ByteTokenizer:
    """One token per UTF-8 byte, as a byte-level BPE decodes a piece that is not a whole character."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}


TOKENIZER = ByteTokenizer()


def parse(item: Any, context: int = 100, default: int = 16) -> ChatRequest:
    return parse_request(item, TOKENIZER, context, default)


def chat(text: str = "hi", **params: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **params}


# items -----------------------------------------------------------------------------------------

def test_a_chat_item_is_templated_and_tokenized_with_its_parameters() -> None:
    request = parse(chat("hi", max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop=["x", "yz"]))
    assert request.prompt_ids == list(b"<user>hi<assistant>")
    assert (request.max_tokens, request.temperature, request.top_p, request.seed, request.stop) == \
        (5, 0.5, 0.9, 7, ("x", "yz"))


def test_defaults_and_the_other_shapes_of_a_prompt() -> None:
    request = parse({"prompt": "abc"})
    assert request.prompt_ids == list(b"abc") and request.max_tokens == 16
    assert (request.temperature, request.top_p, request.seed, request.stop) == (1.0, 1.0, None, ())
    parts = {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert parse({"messages": [parts]}).prompt_ids == list(b"<system>ab<assistant>")
    assert parse(chat(stop="q")).stop == ("q",)
    assert parse({"prompt": "x" * 95}).max_tokens == 5  # the default stops at the context


@pytest.mark.parametrize("item, message", [
    ("text", "an item is a dict"),
    ({"prompt": "a", "max_token": 3}, "unknown field.*max_token"),
    ({}, "exactly one of 'messages'"),
    ({"prompt": "a", "messages": []}, "exactly one of 'messages'"),
    ({"prompt": ""}, "non-empty string"),
    ({"prompt": 3}, "non-empty string"),
    ({"messages": []}, "non-empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role must be one of"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content must be a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "unknown field.*tool_calls"),
    (chat(max_tokens=0), "'max_tokens' must be an integer >= 1"),
    (chat(max_tokens=2.5), "'max_tokens' must be an integer"),
    (chat(max_tokens=True), "'max_tokens' must be an integer"),
    (chat(temperature=-0.1), "'temperature' must be a number from 0 to 2"),
    (chat(temperature="hot"), "'temperature' must be a number"),
    (chat(temperature=float("nan")), "'temperature' must be a number"),
    (chat(top_p=0), "'top_p' must be a number above 0"),
    (chat(top_p=1.5), "'top_p' must be a number above 0"),
    (chat(seed="1"), "'seed' must be a 64-bit integer"),
    (chat(seed=2**64), "'seed' must be a 64-bit integer"),
    (chat(stop=["a", ""]), "'stop' must be"),
    (chat(stop=["a", "b", "c", "d", "e"]), "'stop' must be"),
    (chat(stop=5), "'stop' must be"),
])
def test_a_bad_item_is_refused_with_what_is_wrong(item: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse(item)
    assert issubclass(InvalidInput, ValueError)


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized() -> None:
    class Counting(ByteTokenizer):
        calls = 0

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            Counting.calls += 1
            return super().__call__(text, add_special_tokens)

    with pytest.raises(InvalidInput, match="the prompt has 401 characters: more than this model's context of 100"):
        parse_request({"prompt": "x" * 401}, Counting(), 100, 16, max_token_chars=4)
    assert Counting.calls == 0
    with pytest.raises(InvalidInput, match="context is 100 tokens"):  # within the bound: tokenized, then refused
        parse_request({"prompt": "x" * 400}, Counting(), 100, 16, max_token_chars=4)


def test_too_long_for_the_context_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"context is 100 tokens, but 107 were requested \(7 in the prompt, "
                                              r"100 in max_tokens\)"):
        parse({"prompt": "x" * 7, "max_tokens": 100})
    with pytest.raises(InvalidInput, match="the prompt alone has 120"):
        parse({"prompt": "x" * 120})
    assert parse({"prompt": "x" * 7, "max_tokens": 93}).max_tokens == 93  # exactly the context fits


# text deltas -----------------------------------------------------------------------------------

def test_a_delta_never_ends_inside_a_utf8_character() -> None:
    stream = TextStream(TOKENIZER)
    text = "a€😀b"
    deltas = [stream.push(byte) for byte in text.encode()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert deltas[1:4] == ["", "", "€"] and deltas[4:8] == ["", "", "", "😀"]


def test_flush_gives_an_incomplete_character_at_the_end() -> None:
    stream = TextStream(TOKENIZER, context=list(b"ctx"))
    assert stream.push("é".encode()[0]) == ""
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""


@pytest.mark.parametrize("pieces, stops, emitted, stopped", [
    (["hel", "lo"], ["lo w"], ["he", "l"], False),  # "l", then "lo", could start "lo w": held
    (["hel", "lo", " wor"], ["lo w"], ["he", "l", ""], True),
    (["ab", "cd"], ["bc"], ["a", ""], True),  # a stop across two deltas
    (["xyz"], ["q"], ["xyz"], False),
    (["aXb"], ["X", "aX"], [""], True),  # the earliest stop wins
    (["a", "b"], [], ["a", "b"], False),
])
def test_text_that_could_start_a_stop_string_is_held_back(
        pieces: list[str], stops: list[str], emitted: list[str], stopped: bool) -> None:
    stops_filter = StopFilter(stops)
    out = [stops_filter.feed(piece) for piece in pieces]
    assert [text for text, _ in out] == emitted
    assert any(hit for _, hit in out) == stopped


def test_held_text_is_flushed_when_no_stop_string_comes() -> None:
    stops = StopFilter(["lo w"])
    assert stops.feed("hello") == ("hel", False)
    assert stops.flush() == "lo"


# the end of an answer -----------------------------------------------------------------------

def generation(max_tokens: int = 10, stop: tuple[str, ...] = ()) -> Generation:
    request = ChatRequest(list(b"p"), max_tokens, temperature=0, stop=stop)
    return Generation(request, TOKENIZER, frozenset({END}))


def run(gen: Generation, tokens: list[int]) -> list[Any]:
    chunks: list[Any] = []
    for token in tokens:
        step = gen.advance(token)
        chunks += step.chunks
        if step.finished:
            break
    return chunks


def test_the_end_token_ends_with_stop_and_the_counts() -> None:
    chunks = run(generation(), [*b"ok", END, *b"never"])
    assert chunks == ["o", "k", {"finish_reason": "stop",
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}]


def test_max_tokens_ends_with_length_and_flushes_held_text() -> None:
    chunks = run(generation(max_tokens=3, stop=("cd",)), list(b"abcz"))
    assert chunks == ["a", "b", "c", {"finish_reason": "length",
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}]


def test_a_stop_string_ends_with_stop_without_the_stop_string() -> None:
    chunks = run(generation(stop=("cd",)), list(b"abcdef"))
    assert chunks == ["a", "b", {"finish_reason": "stop",
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}]
    # A stop string completed by the last allowed token is a stop, not a length.
    assert run(generation(max_tokens=4, stop=("cd",)), list(b"abcd"))[-1]["finish_reason"] == "stop"


# sampling --------------------------------------------------------------------------------------

def test_greedy_takes_the_argmax_it_is_given() -> None:
    assert Sampler(ChatRequest([1], 1, temperature=0)).choose(torch.tensor([0.0, 5.0]), greedy=1) == 1


def test_a_seeded_sampler_repeats_its_draws_whatever_else_is_drawn() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    first = Sampler(ChatRequest([1], 1, temperature=1.0, seed=42))
    draws = [first.choose(logits, 0) for _ in range(20)]
    torch.manual_seed(123)  # the global generator is not the item's
    torch.rand(100)
    second = Sampler(ChatRequest([1], 1, temperature=1.0, seed=42))
    assert [second.choose(logits, 0) for _ in range(20)] == draws
    assert len(set(draws)) > 1


def test_top_p_keeps_the_smallest_set_that_reaches_it() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    sampler = Sampler(ChatRequest([1], 1, temperature=1.0, top_p=0.5, seed=1))
    assert {sampler.choose(logits, 0) for _ in range(50)} == {0}
    sampler = Sampler(ChatRequest([1], 1, temperature=1.0, top_p=0.8, seed=1))
    assert {sampler.choose(logits, 0) for _ in range(200)} == {0, 1}
