"""Unit tests of rstreamer.messages: request entries and reply messages (no Redis)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rstreamer import codec
from rstreamer.batching import Failure, Outcome
from rstreamer.errors import DecodeError
from rstreamer.messages import (
    DEADLINE,
    INDEX,
    PAYLOAD,
    TOKEN,
    MalformedEntry,
    Request,
    pack_results,
    parse_request,
    reply_address,
    unpack_results,
)

MAX = 1024 * 1024


def entry(token=b"client-1:7", index=b"3", deadline=b"1700000000250", payload=None, **drop):
    fields = {TOKEN: token, INDEX: index, DEADLINE: deadline, PAYLOAD: codec.packb({"x": 1}) if payload is None else payload}
    return {key: value for key, value in fields.items() if key.decode() not in drop}


def malformed(fields, max_bytes=MAX):
    with pytest.raises(MalformedEntry) as caught:
        parse_request(b"1-0", fields, max_bytes)
    return caught.value


def test_parse_request_decodes_a_valid_entry():
    request = parse_request(b"1700000000000-5", entry(), MAX)
    assert request == Request(b"1700000000000-5", "client-1:7", 3, 1700000000.25, {"x": 1})


def test_parse_request_decodes_array_payloads():
    payload = codec.packb(np.arange(6, dtype=np.float32).reshape(2, 3))
    request = parse_request(b"1-0", entry(payload=payload), MAX)
    np.testing.assert_array_equal(request.payload, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_reply_address_reads_token_and_index():
    assert reply_address(entry()) == ("client-1:7", 3)


@pytest.mark.parametrize(
    "fields",
    [None, {}, entry(t=True), entry(i=True), entry(index=b"three"), entry(token="client-1:7")],
    ids=["none", "empty", "no-token", "no-index", "bad-index", "str-token"],
)
def test_reply_address_is_none_without_a_valid_token_and_index(fields):
    assert reply_address(fields) is None


@pytest.mark.parametrize("token", [b"../x:1", b"a:b:c", b"nocolon", b"c:", b":1", b"", b"c:1\n", b"\xff:1", b"c/d:1"])
def test_parse_request_rejects_an_invalid_reply_token_without_naming_it(token):
    error = malformed(entry(token=token))
    assert error.token is None
    assert isinstance(error, DecodeError)


@pytest.mark.parametrize("fields", [None, {}, entry(t=True), entry(i=True), entry(index=b"x")])
def test_parse_request_rejects_a_missing_address(fields):
    assert malformed(fields).token is None


@pytest.mark.parametrize("deadline", [b"soon", b"1.5", b"", None], ids=["word", "float", "empty", "missing"])
def test_parse_request_rejects_a_bad_deadline_but_keeps_the_address(deadline):
    fields = entry(d=True) if deadline is None else entry(deadline=deadline)
    error = malformed(fields)
    assert (error.token, error.index) == ("client-1:7", 3)
    assert "deadline" in str(error)


def test_parse_request_rejects_a_missing_payload_but_keeps_the_address():
    error = malformed(entry(p=True))
    assert (error.token, error.index) == ("client-1:7", 3)
    assert "payload" in str(error)


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", msgpack.packb(msgpack.ExtType(99, b"?"))])
def test_parse_request_rejects_an_undecodable_payload_but_keeps_the_address(payload):
    error = malformed(entry(payload=payload, index=b"12"))
    assert (error.token, error.index) == ("client-1:7", 12)
    assert "undecodable" in str(error)


def test_parse_request_rejects_an_oversize_payload_but_keeps_the_address():
    payload = codec.packb("x" * 500)
    error = malformed(entry(payload=payload), max_bytes=100)
    assert (error.token, error.index) == ("client-1:7", 3)
    assert "exceeds" in str(error)
    assert parse_request(b"1-0", entry(payload=payload), len(payload)).payload == "x" * 500


def test_results_round_trip_with_successes_and_every_failure_kind():
    results = [
        (0, Outcome(True, value={"label": "cat", "score": 0.9})),
        (1, Outcome(False, failure=Failure("ValueError", "bad input", "remote"))),
        (2, Outcome(True, value=None)),
        (3, Outcome(False, failure=Failure("StreamerTimeout", "expired", "timeout"))),
        (4, Outcome(False, failure=Failure("BatchSizeMismatch", "1 for 2", "mismatch"))),
        (5, Outcome(False, failure=Failure("PoisonItem", "too many deliveries", "dead"))),
    ]
    assert unpack_results(pack_results(results)) == results


def test_a_failure_without_details_is_sent_as_an_unknown_error():
    [(index, outcome)] = unpack_results(pack_results([(4, Outcome(False))]))
    assert index == 4
    assert outcome.failure == Failure("Error", "unknown failure", "remote")


def test_results_round_trip_arrays():
    [(_, outcome)] = unpack_results(pack_results([(0, Outcome(True, value=np.eye(3)))]))
    np.testing.assert_array_equal(outcome.value, np.eye(3))


def test_a_non_encodable_output_fails_only_its_own_row_with_encode_error():
    results = [(0, Outcome(True, value=1)), (1, Outcome(True, value=object())), (2, Outcome(True, value="ok"))]
    unpacked = unpack_results(pack_results(results))
    assert [(index, outcome.ok) for index, outcome in unpacked] == [(0, True), (1, False), (2, True)]
    assert [unpacked[0][1].value, unpacked[2][1].value] == [1, "ok"]
    failure = unpacked[1][1].failure
    assert failure.type == "EncodeError"
    assert failure.kind == "remote"
    assert "object" in failure.message


def test_an_object_dtype_array_output_fails_only_its_own_row():
    results = [(0, Outcome(True, value=np.array([{}], dtype=object))), (1, Outcome(True, value=np.zeros(2)))]
    unpacked = unpack_results(pack_results(results))
    assert unpacked[0][1].failure.type == "EncodeError"
    np.testing.assert_array_equal(unpacked[1][1].value, np.zeros(2))


def test_unpack_results_accepts_a_failure_without_a_kind_as_remote():
    [(_, outcome)] = unpack_results(msgpack.packb([[0, False, ["ValueError", "old worker"]]]))
    assert outcome.failure == Failure("ValueError", "old worker", "remote")


def test_unpack_results_ignores_extra_failure_fields_from_a_newer_worker():
    [(_, outcome)] = unpack_results(msgpack.packb([[0, False, ["ValueError", "new worker", "remote", {"tb": 1}]]]))
    assert outcome.failure == Failure("ValueError", "new worker", "remote")


@pytest.mark.parametrize(
    "rows",
    [
        {"0": [True, 1]},
        "rows",
        [[0, True]],
        [[0, True, 1, 2]],
        [["0", True, 1]],
        [[0.5, True, 1]],
        [(0, True, 1), 5],
        [[0, False, 5]],
        [[0, False, None]],
        [[0, False, []]],
        [[0, False, ["OnlyType"]]],
    ],
    ids=[
        "dict", "str", "short-row", "long-row", "str-index", "float-index", "non-list-row",
        "int-failure", "none-failure", "empty-failure", "one-field-failure",
    ],
)
def test_unpack_results_rejects_malformed_replies_with_decode_error(rows):
    with pytest.raises(DecodeError):
        unpack_results(msgpack.packb(rows))


def test_unpack_results_rejects_garbage_and_oversize_messages():
    with pytest.raises(DecodeError):
        unpack_results(b"\xc1\xc1")
    with pytest.raises(DecodeError):
        unpack_results(pack_results([(0, Outcome(True, value="x" * 200))]), max_bytes=100)
