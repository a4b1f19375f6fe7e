"""The chat model's requests, one answer's text as it grows, and token sampling.

:func:`parse_request` checks an item (see ``docs/streaming.md``, "The chat model") and
tokenizes its prompt; :class:`Generation` follows one answer token by token: it samples the
next token with the item's own generator, turns tokens into text deltas that never split a
UTF-8 character nor a stop string, and decides when the answer ends.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rstreamer.errors import InvalidInput
from rstreamer.model.generative import Step

FIELDS = frozenset({"messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop"})
"""The keys an item may have."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Message roles, and the role the chat template gets for each (OpenAI's ``developer`` is a system message)."""
MAX_STOPS = 4
"""Most stop strings of an item (as OpenAI's API)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds a torch generator takes."""
CONTEXT_WINDOW = 5
"""Prompt tokens decoded along with the answer, so that a tokenizer that drops a leading space
of a piece decoded alone still gives the right text."""


@dataclass(frozen=True)
class ChatRequest:
    """A checked item: its prompt's token ids and its sampling parameters."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the most likely token."""
        return self.temperature == 0


def parse_request(item: Any, tokenizer: Any, context: int, default_max_tokens: int,
                  max_token_chars: int | None = None) -> ChatRequest:
    """Check an item and tokenize its prompt; raises :class:`~rstreamer.errors.InvalidInput`
    saying what is wrong. ``max_token_chars`` (the most characters one token stands for) refuses
    a prompt that cannot fit the context before it is tokenized."""
    if not isinstance(item, dict):
        raise InvalidInput(f"an item is a dict with 'messages' or 'prompt', got {type(item).__name__}")
    unknown = sorted(str(key) for key in item if key not in FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field(s) {', '.join(unknown)}; an item has {', '.join(sorted(FIELDS))}")
    prompt_ids = _prompt_ids(item, tokenizer, context, max_token_chars)
    max_tokens = _max_tokens(item.get("max_tokens"), len(prompt_ids), context, default_max_tokens)
    return ChatRequest(prompt_ids, max_tokens, _number(item, "temperature", 1.0, 0.0, 2.0),
                       _top_p(item.get("top_p", 1.0)), _seed(item.get("seed")), _stops(item.get("stop")))


def _prompt_ids(item: dict[str, Any], tokenizer: Any, context: int, max_token_chars: int | None) -> list[int]:
    has_messages, has_prompt = item.get("messages") is not None, item.get("prompt") is not None
    if has_messages == has_prompt:
        raise InvalidInput("an item has exactly one of 'messages' (a chat) or 'prompt' (a text to continue)")
    if has_prompt:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise InvalidInput("'prompt' must be a non-empty string")
        text = item["prompt"]
    else:
        text = tokenizer.apply_chat_template(_messages(item["messages"]), add_generation_prompt=True,
                                             tokenize=False)
    if max_token_chars and len(text) > context * max_token_chars:
        # More tokens than the context for certain: refused without the cost of tokenizing it.
        raise InvalidInput(f"the prompt has {len(text)} characters: more than this model's context of {context} "
                           f"tokens can hold; shorten it")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InvalidInput("the prompt has no tokens")
    return ids


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list of {'role', 'content'} objects")
    return [_message(index, message) for index, message in enumerate(messages)]


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidInput(f"{where} must be an object with 'role' and 'content'")
    extra = sorted(str(key) for key in message if key not in ("role", "content", "name"))
    if extra:
        raise InvalidInput(f"{where} has unknown field(s) {', '.join(extra)}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidInput(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    return {"role": ROLES[role], "content": _content(where, message.get("content"))}


def _content(where: str, content: Any) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        return "".join(part["text"] for part in content)
    raise InvalidInput(f"{where}.content must be a string or a list of text parts")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_tokens(value: Any, prompt: int, context: int, default: int) -> int:
    if value is None:
        if prompt >= context:
            raise InvalidInput(f"this model's context is {context} tokens, and the prompt alone has {prompt}; "
                                 f"shorten the prompt")
        return min(default, context - prompt)
    if not _is_int(value) or value < 1:
        raise InvalidInput(f"'max_tokens' must be an integer >= 1, got {value!r}")
    if prompt + value > context:
        raise InvalidInput(f"this model's context is {context} tokens, but {prompt + value} were requested "
                             f"({prompt} in the prompt, {value} in max_tokens); shorten the prompt or max_tokens")
    return int(value)


def _number(item: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = item.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidInput(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


def _top_p(value: Any) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1):
        raise InvalidInput(f"'top_p' must be a number above 0 and at most 1, got {value!r}")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise InvalidInput(f"'seed' must be a 64-bit integer, got {value!r}")
    return int(value)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(stop, str) and stop for stop in stops)):
        raise InvalidInput(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


# sampling -------------------------------------------------------------------------------------


class Sampler:
    """Chooses one sequence's tokens: greedy at temperature 0, else from its own generator.

    The generator is the sequence's alone (seeded from the item's ``seed``, or at random), and
    each token takes exactly one draw from it, so its draws never depend on the other sequences
    of the batch.
    """

    def __init__(self, request: ChatRequest) -> None:
        self.temperature = request.temperature
        self.top_p = request.top_p
        self.generator: torch.Generator | None = None
        if not request.greedy:
            seed = request.seed if request.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed)

    def choose(self, logits: torch.Tensor, greedy: int) -> int:
        """The next token from one row of logits; ``greedy`` is the row's argmax, already known."""
        if self.generator is None:
            return greedy
        # The generator is a CPU one (the same draws wherever the model runs): sample on the CPU.
        probs = torch.softmax(logits.cpu() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        ordered, indices = torch.sort(probs, descending=True)
        outside = ordered.cumsum(0) - ordered >= self.top_p  # after the smallest set reaching top_p
        ordered[outside] = 0.0
        return int(indices[torch.multinomial(ordered, 1, generator=self.generator)])


# text -----------------------------------------------------------------------------------------


class TextStream:
    """Token ids in, text deltas out; a delta never ends inside a UTF-8 character.

    Incremental detokenization as TGI and vLLM do it: decode a short window of recent tokens
    and emit what it adds to the text of the window without the newest tokens, unless it ends
    with the replacement character (a character whose bytes have not all come yet).
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context[-CONTEXT_WINDOW:]) if context else []
        self._prefix = 0  # first token of the window decoded
        self._read = len(self._ids)  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def push(self, token: int) -> str:
        """Add a token; the text it completes (maybe empty)."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """The text not emitted yet (at the end of the answer, even an incomplete character)."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):] if len(now) > len(before) else ""


class StopFilter:
    """Holds back text that could be the start of a stop string; finds the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._longest = max((len(stop) for stop in self.stops), default=0)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that can be emitted now, and whether a stop string was met (the text before
        it is then all there is: the stop string and what follows are dropped)."""
        if not self.stops:
            return text, False
        pending = self._pending + text
        hits = [index for stop in self.stops if (index := pending.find(stop)) >= 0]
        if hits:
            self._pending = ""
            return pending[:min(hits)], True
        keep = self._held(pending)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], False

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0

    def flush(self) -> str:
        """What was held back (the answer ended without the stop string)."""
        pending, self._pending = self._pending, ""
        return pending


def final_chunk(finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of every answer: why it ended, and the token counts."""
    return {"finish_reason": finish_reason,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class Generation:
    """One answer in progress: its next input token, its sampler, its text and its end."""

    def __init__(self, request: ChatRequest, tokenizer: Any, end_ids: frozenset[int]) -> None:
        self.request = request
        self.next_input = request.prompt_ids[-1]  # the prompt's last token is fed by the first step
        self.sampler = Sampler(request)
        self.completion_tokens = 0
        self._end_ids = end_ids
        self._text = TextStream(tokenizer, request.prompt_ids)
        self._stops = StopFilter(request.stop)

    def advance(self, token: int) -> Step:
        """Take the step's token: the text delta it completes, and the final chunk if it ended the answer."""
        self.completion_tokens += 1
        self.next_input = token
        if token in self._end_ids:
            return self._finish("stop", self._text.flush())
        delta = self._text.push(token)
        if self.completion_tokens >= self.request.max_tokens:
            return self._finish("length", delta + self._text.flush())
        ready, stopped = self._stops.feed(delta)
        if stopped:
            return self._done("stop", ready)
        return Step([ready] if ready else [])

    def _finish(self, reason: str, delta: str) -> Step:
        """The answer ends here (``reason``) unless its last text holds a stop string (then "stop")."""
        ready, stopped = self._stops.feed(delta)
        if stopped:
            return self._done("stop", ready)
        return self._done(reason, ready + self._stops.flush())

    def _done(self, reason: str, text: str) -> Step:
        chunks: list[Any] = [text] if text else []
        chunks.append(final_chunk(reason, len(self.request.prompt_ids), self.completion_tokens))
        return Step(chunks, finished=True)
