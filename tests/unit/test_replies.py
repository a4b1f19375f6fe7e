"""rstreamer.wire.replies: one undecodable answer in a reply message costs only its own item."""
from __future__ import annotations

import msgpack
import pytest

from rstreamer.batching.batcher import Outcome
from rstreamer.errors import RemoteError
from rstreamer.wire.messages import pack_results, unpack_results
from rstreamer.wire.replies import UndecodableReply, decode_reply, undecodable


def values(results):
    return {index: (outcome.value if outcome.ok else outcome.failure.type) for index, outcome in results}


def test_a_good_message_decodes_as_unpack_results_does():
    [data] = pack_results([(0, Outcome(True, value=[1, 2])), (1, Outcome(True, value="x"))])
    assert decode_reply(data) == unpack_results(data)


def test_a_map_key_msgpack_cannot_rebuild_fails_only_its_row():
    # msgpack encodes a tuple key as an array; decoding it gives an unhashable list key.
    data = msgpack.packb([[0, True, "a"], [1, True, {(1, 2): 3}], [2, True, "c"]])
    results = decode_reply(data)
    assert values(results) == {0: "a", 1: "DecodeError", 2: "c"}
    assert "could not be decoded" in results[1][1].failure.message


def test_a_row_over_the_decode_limit_fails_alone():
    data = msgpack.packb([[0, True, b"x" * 5000], [1, True, b"small"], [2, True, b"y" * 5000]])
    results = decode_reply(data, max_bytes=4096)
    assert values(results) == {0: "DecodeError", 1: b"small", 2: "DecodeError"}


@pytest.mark.parametrize(
    "data", [b"\xc1", b"not msgpack", msgpack.packb([[0, True, "a"]])[:-1], msgpack.packb([["x", 1]])])
def test_a_message_whose_rows_cannot_be_told_apart_is_undecodable(data):
    with pytest.raises(UndecodableReply):
        decode_reply(data)


def test_undecodable_is_a_server_error():
    error = undecodable(UndecodableReply("bad"))
    assert isinstance(error, RemoteError) and error.http_status == 500


@pytest.mark.parametrize("sizes", [range(250, 258), range(65_528, 65_536)], ids=["bin8-bin16", "bin16-bin32"])
def test_outputs_on_either_side_of_a_bin_header_size_round_trip(sizes):
    # A row wraps its encoded output in a msgpack bin whose header grows at 256 and 65,536 bytes
    # (a bytes value of n bytes encodes in n + 2 or n + 3), so these outputs cross both edges.
    for n in sizes:
        value = bytes(n)
        assert unpack_results(pack_results([(0, Outcome(True, value=value))])[0]) == [(0, Outcome(True, value=value))]
