"""Unit tests of rstreamer.wire.chunks: chunk messages and what a streaming caller sees of them,
restarts included (no Redis)."""
from __future__ import annotations

import pytest

from rstreamer.batching.batcher import Failure, Outcome
from rstreamer.errors import DeadLettered, DecodeError, RemoteError, StreamerTimeout
from rstreamer.wire.chunks import ChunkReader, Restarted, pack_chunks
from rstreamer.wire.messages import pack_results


def test_chunks_in_order_then_the_end() -> None:
    reader = ChunkReader()
    assert reader.feed(pack_chunks("r1", True, [(0, "a"), (1, "b")])) == (["a", "b"], None)
    assert not reader.done
    assert reader.feed(pack_chunks("r1", True, [(2, "c")], end=True)) == (["c"], None)
    assert reader.done


def test_an_error_comes_after_the_chunks_of_its_message() -> None:
    reader = ChunkReader()
    chunks, error = reader.feed(pack_chunks("r1", True, [(0, 1)], failure=Failure("ValueError", "bad", "remote")))
    assert chunks == [1] and isinstance(error, RemoteError) and error.remote_type == "ValueError"
    assert reader.done
    _, error = ChunkReader().feed(pack_chunks("r", True, [], failure=Failure("StreamerTimeout", "late", "timeout")))
    assert isinstance(error, StreamerTimeout)


def test_a_deterministic_restart_resumes_where_the_caller_was() -> None:
    reader = ChunkReader()
    reader.feed(pack_chunks("old", True, [(0, "a"), (1, "b")]))
    # The new run repeats chunks 0 and 1: skipped, without a marker.
    assert reader.feed(pack_chunks("new", True, [(0, "a")])) == ([], None)
    assert reader.feed(pack_chunks("new", True, [(1, "b"), (2, "c")])) == (["c"], None)


def test_a_deterministic_restart_that_differs_says_so_and_starts_over() -> None:
    # Batched float arithmetic can change a greedy answer: the caller learns it, never a splice.
    reader = ChunkReader()
    reader.feed(pack_chunks("old", True, [(0, "a"), (1, "b"), (2, "c")]))
    assert reader.feed(pack_chunks("new", True, [(0, "a")])) == ([], None)  # held back while it matches
    assert reader.feed(pack_chunks("new", True, [(1, "x"), (2, "y")])) == ([Restarted(3), "a", "x", "y"], None)
    assert reader.feed(pack_chunks("new", True, [(3, "z")], end=True)) == (["z"], None)
    assert reader.done


def test_a_deterministic_restart_that_ends_early_says_so() -> None:
    reader = ChunkReader()
    reader.feed(pack_chunks("old", True, [(0, "a"), (1, "b")]))
    assert reader.feed(pack_chunks("new", True, [(0, "a")], end=True)) == ([Restarted(2), "a"], None)


def test_a_second_restart_while_checking_the_first_checks_again() -> None:
    reader = ChunkReader()
    reader.feed(pack_chunks("one", True, [(0, "a"), (1, "b")]))
    assert reader.feed(pack_chunks("two", True, [(0, "a")])) == ([], None)
    assert reader.feed(pack_chunks("three", True, [(0, "a"), (1, "b"), (2, "c")])) == (["c"], None)
    # After a divergence, the new run is the one later restarts are checked against.
    reader.feed(pack_chunks("four", True, [(0, "q")]))
    assert reader.feed(pack_chunks("five", True, [(0, "q"), (1, "r")])) == (["r"], None)


def test_a_sampling_restart_says_so_and_starts_over() -> None:
    reader = ChunkReader()
    reader.feed(pack_chunks("old", False, [(0, "a"), (1, "b")]))
    assert reader.feed(pack_chunks("new", False, [(0, "x")])) == ([Restarted(2), "x"], None)
    assert reader.feed(pack_chunks("new", False, [(1, "y")])) == (["y"], None)


def test_a_restart_before_any_chunk_needs_no_marker() -> None:
    reader = ChunkReader()
    reader.feed(pack_chunks("old", False, []))
    assert reader.feed(pack_chunks("new", False, [(0, "x")])) == (["x"], None)


def test_a_missing_chunk_is_an_error_not_a_silent_gap() -> None:
    reader = ChunkReader()
    with pytest.raises(DecodeError, match="chunk 0"):
        reader.feed(pack_chunks("r", True, [(1, "b")]))


def test_a_plain_reply_ends_the_stream() -> None:
    (dead,) = pack_results([(0, Outcome(False, failure=Failure("DeadLettered", "too often", "dead")))])
    chunks, error = ChunkReader().feed(dead)
    assert chunks == [] and isinstance(error, DeadLettered)
    (whole,) = pack_results([(0, Outcome(True, value="the whole answer"))])
    reader = ChunkReader()
    assert reader.feed(whole) == (["the whole answer"], None) and reader.done
