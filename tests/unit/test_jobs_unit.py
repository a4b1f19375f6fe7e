"""Unit tests of the pure parts of durable jobs: ids, tokens, encoding, the job hash (no Redis)."""
from __future__ import annotations

import pytest

from rstreamer.batching.batcher import Failure, Outcome
from rstreamer.codec import core as codec
from rstreamer.errors import (
    ConfigError,
    DeadLettered,
    EncodeError,
    InvalidJobId,
    JobNotFound,
    JobTooLarge,
    RemoteError,
)
from rstreamer.jobs.core import (
    JobState,
    Progress,
    check_job_id,
    decode_item,
    encode_items,
    encode_meta,
    log_indexes,
    new_job_id,
    parse_info,
)
from rstreamer.settings import JobSettings
from rstreamer.wire.keys import (
    Keys,
    is_answer_token,
    is_reply_token,
    job_of_token,
    job_token,
)
from rstreamer.wire.messages import pack_results, parse_request, reply_address

JOB = "0123456789abcdef0123456789abcdef"


def test_job_ids_are_32_hex_digits_and_checked():
    assert check_job_id(new_job_id()) and len(new_job_id()) == 32
    for bad in ["", "x" * 32, JOB.upper(), JOB + "0", JOB[:-1], "../" + JOB[3:], None, 12, "job:" + JOB]:
        with pytest.raises(InvalidJobId, match="32 lowercase hex"):
            check_job_id(bad)


def test_job_keys_are_built_only_for_valid_ids():
    keys = Keys("p")
    assert keys.job(JOB) == f"rstreamer:{{p}}:job:{JOB}"
    assert keys.job_results(JOB) == f"rstreamer:{{p}}:job:{JOB}:results"
    with pytest.raises(ValueError):
        keys.job("a:b")


def test_job_token_is_an_answer_token_but_never_a_reply_token():
    token = job_token(JOB)
    assert job_of_token(token) == JOB and is_answer_token(token) and not is_reply_token(token)
    assert job_of_token("abc:1") is None and is_answer_token("abc:1")
    for bad in ["job:" + JOB + ":1", "job:xyz", "job:", "jobs:" + JOB]:
        assert job_of_token(bad) is None and not is_answer_token(bad)
    # a request entry with a job token parses, and is addressed to the job
    fields = {b"v": b"2", b"t": token.encode(), b"i": b"7", b"r": b"1000", b"p": codec.packb(3)}
    assert reply_address(fields) == (token, 7)
    request = parse_request(b"1000-0", fields, 1 << 20)
    assert (request.token, request.index, request.payload) == (token, 7, 3)


def test_encode_items_names_the_item_that_cannot_be_sent():
    assert encode_items([1, "a"], 100, 10) == [codec.packb(1), codec.packb("a")]
    with pytest.raises(EncodeError, match="item 1 is .* over the limit of 100"):
        encode_items([1, "x" * 200], 100, 10)
    with pytest.raises(EncodeError, match="item 0 cannot be sent"):
        encode_items([object()], 100, 10)
    with pytest.raises(JobTooLarge, match="at most 3 items"):
        encode_items(iter(range(4)), 100, 3)


def test_meta_must_be_json():
    assert encode_meta({"a": [1]}) == '{"a":[1]}'
    with pytest.raises(EncodeError, match="JSON"):
        encode_meta({"a": object()})
    with pytest.raises(EncodeError, match="over the limit"):
        encode_meta("x" * 70_000)


def test_job_settings_validate():
    assert JobSettings().job_window >= 1
    with pytest.raises(ConfigError):
        JobSettings(job_window=0)
    with pytest.raises(ConfigError):
        JobSettings(job_ttl=0)


def test_parse_info_and_unknown_job():
    fields = {b"state": b"running", b"total": b"10", b"done": b"3", b"failed": b"1", b"fed": b"8",
              b"window": b"4", b"level": b"", b"meta": b'{"k":1}', b"created": b"1000", b"expires": b"5000"}
    info = parse_info(JOB, fields)
    assert info.state is JobState.RUNNING and info.progress == Progress(3, 1, 10)
    assert info.meta == {"k": 1} and info.level is None and info.created == 1.0 and info.finished is None
    assert info.as_json()["status"] == "running"
    with pytest.raises(JobNotFound, match="expired"):
        parse_info(JOB, {})


def test_stored_answers_decode_to_values_and_error_objects():
    (ok,) = pack_results([(4, Outcome(True, value=[1, 2]))])
    (bad,) = pack_results([(5, Outcome(False, failure=Failure("ValueError", "boom")))])
    (dead,) = pack_results([(6, Outcome(False, failure=Failure("DeadLettered", "too often", "dead")))])
    assert decode_item(4, ok).output == [1, 2]
    error = decode_item(5, bad).output
    assert isinstance(error, RemoteError) and error.remote_type == "ValueError" and "boom" in str(error)
    assert isinstance(decode_item(6, dead).error, DeadLettered)
    assert decode_item(7, None) is None
    assert log_indexes({b"i": b"1,5,3"}) == [1, 5, 3] and log_indexes({b"end": b"done"}) == []
