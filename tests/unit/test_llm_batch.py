"""Unit tests of workers.llm_batch.SlotCache: rows join and leave between decoding steps, and each
row always attends to exactly its own tokens, in order (random keys and values, no model)."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from workers.llm_batch import SlotCache, plan_prefill

LAYERS, HEADS, DIM = 2, 1, 2


class Reference:
    """The same cache as per-row lists of tokens; a token is a (layer-stacked) key and value."""

    def __init__(self) -> None:
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []


def token() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(LAYERS, HEADS, DIM), torch.randn(LAYERS, HEADS, DIM)


def join(cache: SlotCache, ref: Reference, length: int, pad: int = 0) -> None:
    tokens = [token() for _ in range(length)]
    keys = torch.zeros(LAYERS, 1, HEADS, length + pad, DIM)
    values = torch.zeros_like(keys)
    for i, (key, value) in enumerate(tokens):
        keys[:, 0, :, pad + i] = key
        values[:, 0, :, pad + i] = value
    cache.join([(keys[layer], values[layer]) for layer in range(LAYERS)], [length])
    ref.rows.append(tokens)


def decode(cache: SlotCache, ref: Reference) -> None:
    """One decoding step: every row gets a token; check what each row attends to."""
    positions, mask = cache.decode_inputs()
    new = [token() for _ in ref.rows]
    for layer in range(LAYERS):
        keys = torch.stack([key[layer] for key, _ in new]).unsqueeze(2)
        values = torch.stack([value[layer] for _, value in new]).unsqueeze(2)
        seen_keys, seen_values = cache.update(keys, values, layer)
        for row, tokens in enumerate(ref.rows):
            visible = mask[row, 0, 0]
            expected = torch.stack([key[layer] for key, _ in tokens] + [new[row][0][layer]], dim=1)
            assert torch.equal(seen_keys[row][:, visible], expected), f"row {row} layer {layer}"
            expected_v = torch.stack([value[layer] for _, value in tokens] + [new[row][1][layer]], dim=1)
            assert torch.equal(seen_values[row][:, visible], expected_v)
    assert positions.squeeze(1).tolist() == [len(tokens) for tokens in ref.rows]
    cache.advance()
    for row, tokens in enumerate(ref.rows):
        tokens.append(new[row])


def remove(cache: SlotCache, ref: Reference, row: int) -> None:
    moved = cache.remove(row)
    last = ref.rows.pop()
    if moved is not None:
        assert moved == len(ref.rows)
        ref.rows[row] = last


def test_rows_join_and_leave_and_each_attends_to_its_own_tokens() -> None:
    cache, ref = SlotCache(LAYERS, HEADS, DIM, rows=2, columns=4), Reference()
    join(cache, ref, 3)
    decode(cache, ref)
    join(cache, ref, 1, pad=2)  # a shorter prompt, left-padded in its prefill
    join(cache, ref, 9)  # longer than the window: every row moves right
    decode(cache, ref)
    remove(cache, ref, 0)  # the last row moves into row 0
    decode(cache, ref)
    join(cache, ref, 0)  # a one-token prompt: nothing cached yet
    for _ in range(6):  # past the columns it has: compacts or grows
        decode(cache, ref)
    remove(cache, ref, 2)
    remove(cache, ref, 1)
    decode(cache, ref)
    remove(cache, ref, 0)
    assert cache.rows == 0 and cache.end == 0


@pytest.mark.parametrize("seed", range(4))
def test_many_random_joins_and_leaves(seed: int) -> None:
    rng = random.Random(seed)
    cache, ref = SlotCache(LAYERS, HEADS, DIM, rows=1, columns=2), Reference()
    for _ in range(150):
        action = rng.random()
        if action < 0.25 and len(ref.rows) < 8:
            join(cache, ref, rng.choice([rng.randint(0, 4), rng.randint(0, 30)]), pad=rng.randint(0, 3))
        elif action < 0.5 and ref.rows:
            remove(cache, ref, rng.randrange(len(ref.rows)))
        elif ref.rows:
            decode(cache, ref)
    # Columns nobody attends to are dropped: the window is the longest live row, plus one.
    assert cache.window == max((len(tokens) for tokens in ref.rows), default=0) + 1


def test_an_empty_cache_goes_back_to_its_first_size() -> None:
    cache, ref = SlotCache(LAYERS, HEADS, DIM, rows=1, columns=2), Reference()
    join(cache, ref, 20)
    join(cache, ref, 3)
    assert cache.keys.shape[1] >= 2 and cache.keys.shape[3] > 20
    remove(cache, ref, 1)
    remove(cache, ref, 0)
    assert (cache.keys.shape[1], cache.keys.shape[3]) == (1, 2)


def test_prefill_groups_similar_lengths_within_the_budget() -> None:
    prompts = [[0] * n for n in (5, 100, 6, 7, 120)]
    assert plan_prefill(prompts, budget=40) == [[0, 2, 3], [1], [4]]
    assert plan_prefill(prompts, budget=10_000) == [[0, 2, 3, 1, 4]]
    assert plan_prefill([[], []]) == [[0, 1]]


def test_a_long_prompt_joins_after_the_oldest_rows_left() -> None:
    # The window starts right of column 0 (its oldest rows left) and a longer prompt joins.
    cache, ref = SlotCache(LAYERS, HEADS, DIM, rows=2, columns=4), Reference()
    join(cache, ref, 2)
    decode(cache, ref)
    join(cache, ref, 0)
    remove(cache, ref, 0)
    assert cache.left == cache.end == 3
    join(cache, ref, 5)
    decode(cache, ref)
    assert cache.starts == [cache.end - 1, cache.end - 6]


def test_the_runner_keeps_every_tensor_on_the_models_device() -> None:
    # A model on torch's "meta" device stands for a GPU here: a tensor made on the CPU beside
    # it fails the forward pass as it would beside a CUDA model.
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.llm_batch import BatchRunner

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    runner = BatchRunner(model)
    runner.prefill([[1, 2, 3], [4, 5]])
    logits = runner.decode([6, 7])
    runner.remove(0)
    runner.prefill([[8]])
    assert (logits.device.type, tuple(logits.shape)) == ("meta", (2, 64))
    assert runner.cache.keys.device.type == "meta" and runner.cache.rows == 2


def test_a_model_without_the_cache_argument_is_refused_by_name() -> None:
    class OlderForward(torch.nn.Linear):
        config = None

        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None, **kwargs: Any) -> Any:
            return input_ids

    from workers.llm_batch import BatchRunner

    with pytest.raises(RuntimeError, match="passes the KV cache under another name"):
        BatchRunner(OlderForward(1, 1))
