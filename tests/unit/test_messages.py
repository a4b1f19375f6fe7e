"""Unit tests of rstreamer.wire.messages: request entries and reply messages (no Redis)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rstreamer.batching.batcher import Failure, Outcome
from rstreamer.codec import core as codec
from rstreamer.errors import DecodeError
from rstreamer.wire.messages import (
    DEADLINE,
    INDEX,
    MAX_INDEX,
    MAX_WIRE_MS,
    PAYLOAD,
    REMAINING,
    TOKEN,
    VERSION,
    WIRE_VERSION,
    MalformedEntry,
    Request,
    entry_version,
    parse_request,
    reply_address,
    reply_ttl_ms,
    reply_version,
    unpack_results,
)
from rstreamer.wire.messages import pack_results as pack_messages

MAX = 1024 * 1024


def entry(token=b"client-1:7", index=b"3", deadline=b"1700000000250", payload=None, **drop):
    """A version-1 entry (no version field, an absolute deadline): what rstreamer 0.1 clients send."""
    packed = codec.packb({"x": 1}) if payload is None else payload
    fields = {TOKEN: token, INDEX: index, DEADLINE: deadline, PAYLOAD: packed}
    return {key: value for key, value in fields.items() if key.decode() not in drop}


def entry_v2(remaining=b"1500", version=b"2", **kwargs):
    return {VERSION: version, REMAINING: remaining, **entry(**kwargs)}


def pack_results(results, version=WIRE_VERSION, max_bytes=codec.DEFAULT_MAX_BYTES):
    """One reply message (these results fit in one)."""
    [message] = pack_messages(results, version, max_bytes)
    return message


def malformed(fields, max_bytes=MAX):
    with pytest.raises(MalformedEntry) as caught:
        parse_request(b"1-0", fields, max_bytes)
    return caught.value


def test_parse_request_decodes_a_valid_version_1_entry_with_its_deadline_moved_to_the_server_clock():
    request = parse_request(b"1700000000000-5", entry(), MAX, wall_to_server=2.0)
    assert request == Request(b"1700000000000-5", "client-1:7", 3, 1700000002.25, {"x": 1}, version=1)


def test_parse_request_counts_a_version_2_deadline_from_the_entry_id_on_the_server_clock():
    # d (the client's wall clock) is ignored: the entry id is Redis's time at XADD.
    request = parse_request(b"1700000000000-5", entry_v2(remaining=b"1500", deadline=b"1"), MAX, wall_to_server=99.0)
    assert request == Request(b"1700000000000-5", "client-1:7", 3, 1700000001.5, {"x": 1}, version=2)


@pytest.mark.parametrize("version", [b"3", b"99", b"x", b""])
def test_parse_request_answers_an_unknown_version_with_a_clear_error_to_its_caller(version):
    error = malformed(entry_v2(version=version))
    assert (error.token, error.index) == ("client-1:7", 3)
    assert "wire version" in str(error) and "upgrade the workers" in str(error)


def test_entry_and_reply_versions():
    assert entry_version(entry()) == 1
    assert entry_version(entry_v2()) == 2
    assert entry_version(entry_v2(version=b"x")) is None
    assert [reply_version(f) for f in (entry(), entry_v2(), entry_v2(version=b"7"))] == [1, 2, 2]


@pytest.mark.parametrize("remaining", [b"soon", b"", None])
def test_parse_request_rejects_a_bad_version_2_timeout(remaining):
    fields = entry_v2(remaining=remaining or b"")
    if remaining is None:
        del fields[REMAINING]
    assert "deadline" in str(malformed(fields))


def test_parse_request_decodes_array_payloads():
    payload = codec.packb(np.arange(6, dtype=np.float32).reshape(2, 3))
    request = parse_request(b"1-0", entry(payload=payload), MAX)
    np.testing.assert_array_equal(request.payload, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_reply_address_reads_token_and_index():
    assert reply_address(entry()) == ("client-1:7", 3)


def test_an_index_and_a_time_at_the_edges_of_their_range_are_taken_and_one_past_is_not():
    assert reply_address(entry(index=b"0")) == ("client-1:7", 0)
    assert reply_address(entry(index=str(MAX_INDEX).encode())) == ("client-1:7", MAX_INDEX)
    assert reply_address(entry(index=str(MAX_INDEX + 1).encode())) is None
    assert reply_address(entry(index=b"-1")) is None
    for remaining in (0, MAX_WIRE_MS):
        assert isinstance(parse_request(b"1-0", entry_v2(remaining=str(remaining).encode()), MAX), Request)
    assert "deadline" in str(malformed(entry_v2(remaining=str(MAX_WIRE_MS + 1).encode())))


def test_a_malformed_entry_keeps_the_version_its_error_is_answered_in():
    assert malformed(entry_v2(remaining=b"soon")).version == 2
    assert malformed(entry_v2(p=True)).version == 2  # no payload
    assert malformed(entry_v2(payload=b"\xc1")).version == 2  # undecodable payload
    assert malformed(entry(deadline=b"soon")).version == 1


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


# wire versions, per-item round trip and split replies (issue 10 #2, issue 11 #9) ---------------

@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("size", [0, 255, 256, 65535, 65536, 300_000])
def test_outputs_of_every_size_round_trip_in_both_versions(version, size):
    results = [(0, Outcome(True, value=b"x" * size)), (1, Outcome(True, value="ok"))]
    assert unpack_results(pack_results(results, version)) == results


def test_a_version_1_reply_is_the_bare_list_of_rows_an_old_client_reads():
    message = pack_results([(0, Outcome(True, value=[1, 2])), (1, Outcome(False, failure=Failure("E", "m")))], 1)
    assert msgpack.unpackb(message) == [[0, True, [1, 2]], [1, False, ["E", "m", "remote"]]]


def test_a_version_2_reply_carries_its_version_and_each_output_encoded_alone():
    message = msgpack.unpackb(pack_results([(4, Outcome(True, value={"a": 1}))], 2))
    assert message == {"v": 2, "r": [[4, True, codec.packb({"a": 1})]]}


@pytest.mark.parametrize("version", [1, 2])
def test_an_output_that_encodes_but_cannot_decode_fails_alone(version):
    # 20,000 zeros encode in 20 kB but hold more objects than a client with a 100 kB limit decodes.
    results = [(0, Outcome(True, value=[0] * 20_000)), (1, Outcome(True, value="good"))]
    unpacked = unpack_results(pack_results(results, version, max_bytes=100_000))
    assert unpacked[1] == (1, Outcome(True, value="good"))
    failure = unpacked[0][1].failure
    assert (failure.type, failure.kind) == ("EncodeError", "remote")
    assert "decode" in failure.message


@pytest.mark.parametrize("version", [1, 2])
def test_outputs_over_the_clients_decode_limit_are_split_into_messages_each_within_it(version):
    limit = 100_000
    results = [(i, Outcome(True, value=b"x" * 40_000)) for i in range(5)] + [(5, Outcome(True, value="small"))]
    messages = pack_messages(results, version, max_bytes=limit)
    assert len(messages) > 1 and all(len(m) <= limit for m in messages)
    assert [row for m in messages for row in unpack_results(m, max_bytes=limit)] == results


def test_an_output_alone_over_the_decode_limit_fails_alone():
    results = [(0, Outcome(True, value=b"x" * 50_000)), (1, Outcome(True, value=1))]
    messages = pack_messages(results, max_bytes=10_000)
    rows = [row for m in messages for row in unpack_results(m, max_bytes=10_000)]
    assert rows[1] == (1, Outcome(True, value=1))
    assert rows[0][1].failure.type == "EncodeError" and "exceeds" in rows[0][1].failure.message


def test_a_version_2_output_the_client_cannot_decode_fails_only_its_own_item():
    bad = msgpack.packb({"v": 2, "r": [[0, True, b"\xc1"], [1, True, codec.packb("fine")]]})
    [(_, first), second] = unpack_results(bad)
    assert not first.ok and first.failure.type == "DecodeError"
    assert second == (1, Outcome(True, value="fine"))


@pytest.mark.parametrize("message", [{"v": 3, "r": []}, {"r": []}, {"v": 2}, {"v": 2, "r": 5}])
def test_a_reply_of_an_unknown_version_or_shape_is_a_clear_decode_error(message):
    with pytest.raises(DecodeError, match="version|rows"):
        unpack_results(msgpack.packb(message))


def test_a_reply_lives_until_its_last_callers_deadline_and_at_least_the_floor():
    assert reply_ttl_ms(60.0, [1000.0 + 5], now=1000.0) == 60_000
    assert reply_ttl_ms(2.0, [1000.0 + 5, 1000.0 + 30], now=1000.0) == 31_000
    assert reply_ttl_ms(2.0, [], now=1000.0) == 2_000


def test_enqueue_args_carry_each_calls_remaining_timeout_and_wall_deadline():
    from rstreamer.wire.messages import QueueLimits, enqueue_args

    args = enqueue_args(QueueLimits(10, 2000, "workers"), "c:1",
                        [([b"a", b"b"], 105.5, 0, None), ([b"c"], 100.0 - 1, 2, "acme"), ([b"d"], 101.0, 0, "acme")],
                        now=100.0)
    # No copy of the published levels: '?' (the script reads them).
    assert args == [10, 2000, 500, "workers", "c:1", 2, 3, 1, "?", "acme", 2, 5500, 105500, 0, 0, 1, 0, 99000, 2, 1,
                    1, 1000, 101000, 0, 1, b"a", b"b", b"c", b"d"]
    with_copy = enqueue_args(QueueLimits(10, 2000, "workers"), "c:1", [([b"a"], 101.0, 0, None)], now=100.0,
                             levels=b"")
    assert with_copy[8] == b""  # nothing published: one level, no bound


def test_enqueue_keys_are_the_levels_then_the_level_keys_up_to_the_highest_priority():
    from rstreamer.wire.keys import Keys
    from rstreamer.wire.messages import enqueue_keys

    keys = Keys("p")
    assert enqueue_keys(keys, [0, 0]) == [keys.levels, keys.quotas, *keys.level_keys(0)]
    assert enqueue_keys(keys, [0, 2], ["a"]) == [keys.levels, keys.quotas, keys.bucket("a"), *keys.level_keys(0),
                                                 *keys.level_keys(1), *keys.level_keys(2)]
    # Every key of a level shares the prefix's hash tag (one Redis Cluster slot).
    assert keys.level_keys(1) == ["rstreamer:{p}:requests:1", "rstreamer:{p}:held:1", "rstreamer:{p}:held:1:items",
                                  "rstreamer:{p}:held:1:clock"]


@pytest.mark.parametrize("verdict, priority, words", [
    ((1, 7, 10), 0, "7 items wait undelivered (max_queue=10)"),
    ((1, 7, 5), 1, "7 items wait undelivered at priorities 0-1 (max_queue=5)"),
    ((2, 1900, 2000), 0, "hold 1900 bytes (max_queue_bytes=2000)"),
    ((3, 2500, 0), 0, "the oldest waiting item has waited 2.5s"),
    ((3, 2500, 0), 2, "the oldest waiting item at priority 2 has waited 2.5s"),
    ((5, 2500, 20), 0, "(burst 20 items); retry in 2.500s"),
    ((4, 2, 0), 3, "priority 3 is not served on prefix 'p': its workers serve levels 0-1"),
    ((5, 250, 20), 0, "tenant 't' is over its quota on prefix 'p' (burst 20 items); retry in 0.250s"),
    ((5, -1, 20), 0, "larger than its burst of 20 items on prefix 'p': split it into calls of at most 20"),
])
def test_a_refusal_says_why(verdict, priority, words):
    from rstreamer.errors import CallTooLarge, InvalidPriority, Overloaded, RateLimited
    from rstreamer.wire.messages import Admission, QueueLimits

    admission = Admission.parse([2, 0, 0, 0, *verdict, b"1-0", b"1-1"])
    assert admission.verdicts[0].added and not admission.verdicts[1].added
    assert admission.ids == (b"1-0", b"1-1")
    error = admission.verdicts[1].error("p", QueueLimits(10, 2000, "workers"), priority, "t")
    assert words in str(error)
    kind = CallTooLarge if verdict[:2] == (5, -1) else {4: InvalidPriority, 5: RateLimited}.get(verdict[0], Overloaded)
    assert isinstance(error, kind)
    if kind is RateLimited:
        assert error.retry_after == verdict[1] / 1000


def test_a_version_1_reply_carries_the_values_a_version_1_client_can_decode():
    """During a rolling upgrade an old client reads new workers' answers: tuples and sets as
    lists, arrays as before, and a value it cannot decode fails alone instead of the message."""
    import numpy as np

    from rstreamer.batching.batcher import Outcome
    from rstreamer.codec import core as codec
    from rstreamer.wire.messages import PREVIOUS_VERSION, pack_results

    [message] = pack_results([(0, Outcome(True, value=(1, 2, {3}))), (1, Outcome(True, value=np.arange(2))),
                              (2, Outcome(True, value=2**70))], version=PREVIOUS_VERSION)
    rows = codec.unpackb(message)
    assert rows[0] == [0, True, [1, 2, [3]]]
    assert rows[1][2].tolist() == [0, 1]
    assert rows[2][:2] == [2, False] and "wire version 1" in rows[2][2][1]


def test_a_numeric_array_is_sent_without_decoding_it_again(monkeypatch):
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("decoded to check it")

    outputs = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4), torch.arange(3, dtype=torch.float16)]
    packed = pack_results([(i, Outcome(True, value=value)) for i, value in enumerate(outputs)])
    monkeypatch.setattr(codec, "unpackb", refuse)
    assert pack_results([(i, Outcome(True, value=value)) for i, value in enumerate(outputs)]) == packed
    monkeypatch.undo()
    rows = unpack_results(packed)
    np.testing.assert_array_equal(rows[0][1].value, outputs[0])
    assert torch.equal(rows[2][1].value, outputs[2])


def test_a_boolean_array_with_other_bytes_is_still_refused_before_it_is_sent():
    bad = np.frombuffer(bytes([0, 1, 2]), dtype=np.uint8).view(np.bool_)
    [(_, outcome)] = unpack_results(pack_results([(0, Outcome(True, value=bad))]))
    assert outcome.failure.type == "EncodeError" and "0 and 1" in outcome.failure.message


def test_a_numeric_array_over_the_clients_limit_still_fails_alone():
    rows = [row for m in pack_messages([(0, Outcome(True, value=np.zeros(5_000))), (1, Outcome(True, value=1))],
                                       max_bytes=10_000)
            for row in unpack_results(m, max_bytes=10_000)]
    assert rows[1] == (1, Outcome(True, value=1))
    assert rows[0][1].failure.type == "EncodeError" and "exceeds" in rows[0][1].failure.message


def test_an_empty_tensor_of_a_huge_shape_is_still_refused_before_it_is_sent():
    import torch

    huge = torch.empty(0, 1, 1).expand(0, 2**40, 2**40)  # encodes; decoding it overflows torch's strides
    [(_, outcome)] = unpack_results(pack_results([(0, Outcome(True, value=huge))]))
    assert outcome.failure.type == "EncodeError" and "would not decode" in outcome.failure.message
