"""Unit tests of rstreamer.wire.keys: the key scheme, prefix validation and reply tokens (no Redis)."""
from __future__ import annotations

import dataclasses
import fnmatch
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstreamer.errors import ConfigError
from rstreamer.wire.keys import (
    DEFAULT_PREFIX,
    GROUP,
    REQUESTS_PATTERN,
    Keys,
    is_answer_token,
    is_job_id,
    is_reply_token,
    job_of_token,
    prefix_of_requests_key,
    validate_prefix,
)

PREFIXES = ["default", "a", "Z", "0", "resnet50", "bert-base.v2_int8", "-", ".", "_", "x" * 100]
TOKENS = ["c:0", "client:1", "host-1.pid_2:123", "a" * 64 + ":" + "9" * 20]


def all_keys(keys: Keys) -> list[str]:
    job = "0123456789abcdef0123456789abcdef"
    return ([keys.requests, keys.dead, keys.workers, keys.levels, keys.jobs, keys.job_events]
            + [keys.requests_at(level) for level in range(1, 16)] + keys.job_keys(job)
            + [keys.reply(t) for t in TOKENS] + [keys.cancelled(t) for t in TOKENS]
            + [keys.stream_control(t) for t in TOKENS]
            + [keys.quotas, keys.pace, keys.bucket("acme"), keys.bucket("a@b.c")]
            + [keys.openai_file("file-" + job), keys.openai_batch("batch_" + job), keys.openai_batches(None),
               keys.openai_batches("acme")])


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes (the rule from the cluster specification)."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


# --- key layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_key_starts_with_namespace_and_hash_tagged_prefix(prefix):
    for key in all_keys(Keys(prefix)):
        assert key.startswith(f"rstreamer:{{{prefix}}}:"), key


@pytest.mark.parametrize("prefix", PREFIXES)
def test_no_key_has_an_empty_segment(prefix):
    for key in all_keys(Keys(prefix)):
        assert "::" not in key, key
        assert not key.endswith(":"), key
        assert key.count("{") == 1 and key.count("}") == 1, key


@pytest.mark.parametrize("prefix", PREFIXES)
def test_all_keys_of_a_prefix_share_one_cluster_slot(prefix):
    # the worker's MULTI touches the stream and reply keys together
    assert {hash_tag(key) for key in all_keys(Keys(prefix))} == {prefix}


def test_keys_of_different_prefixes_differ():
    a, b = Keys("a"), Keys("b")
    assert not set(all_keys(a)) & set(all_keys(b))


def test_exact_key_names():
    keys = Keys("bert")
    assert keys.requests == "rstreamer:{bert}:requests"
    assert keys.dead == "rstreamer:{bert}:dead"
    assert keys.workers == "rstreamer:{bert}:workers"
    assert keys.reply("web-1:42") == "rstreamer:{bert}:reply:web-1:42"


def test_keys_of_one_prefix_are_distinct():
    keys = all_keys(Keys("p"))
    assert len(set(keys)) == len(keys)


def test_group_is_a_constant_name_not_a_key():
    assert Keys("a").group == Keys("b").group == GROUP == "workers"


def test_keys_is_frozen_and_hashable():
    keys = Keys("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.prefix = "b"  # type: ignore[misc]
    assert hash(keys) == hash(Keys("a"))
    assert keys == Keys("a") != Keys("b")


def test_requests_pattern_matches_only_requests_keys():
    for prefix in PREFIXES:
        keys = Keys(prefix)
        assert fnmatch.fnmatchcase(keys.requests, REQUESTS_PATTERN)
        assert not fnmatch.fnmatchcase(keys.dead, REQUESTS_PATTERN)
        assert not fnmatch.fnmatchcase(keys.workers, REQUESTS_PATTERN)
        assert not fnmatch.fnmatchcase(keys.reply("c:1"), REQUESTS_PATTERN)


# --- prefixes ------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", ["", None])
def test_empty_prefix_means_default(empty):
    assert validate_prefix(empty) == DEFAULT_PREFIX == "default"
    assert Keys(empty).prefix == "default"
    assert Keys(empty) == Keys("default")
    assert Keys(empty).requests == "rstreamer:{default}:requests"


@pytest.mark.parametrize("prefix", PREFIXES)
def test_valid_prefix_is_returned_unchanged(prefix):
    assert validate_prefix(prefix) == prefix
    assert Keys(prefix).prefix == prefix


@pytest.mark.parametrize(
    "prefix",
    [
        "{a",
        "a}",
        "{a}",
        "a:b",
        ":",
        "a b",
        " a",
        "a ",
        "a\n",
        "a\t",
        "a\x00",
        "a/b",
        "../x",
        "a*",
        "a?",
        "[a]",
        "é",
        "x" * 101,
        "x" * 1000,
        "٣",  # a digit, but not an ASCII one
    ],
    ids=repr,
)
def test_invalid_prefix_raises_config_error(prefix):
    with pytest.raises(ConfigError):
        validate_prefix(prefix)
    with pytest.raises(ConfigError):
        Keys(prefix)


@pytest.mark.parametrize("prefix", [123, b"abc", ["a"], 1.5], ids=repr)
def test_non_str_prefix_raises_config_error(prefix):
    with pytest.raises(ConfigError):
        validate_prefix(prefix)  # type: ignore[arg-type]


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        Keys("a:b")


# --- reply tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("token", TOKENS)
def test_valid_reply_tokens(token):
    assert is_reply_token(token) is True
    assert Keys("p").reply(token) == f"rstreamer:{{p}}:reply:{token}"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "c",
        "c:",
        ":1",
        ":",
        "c:1a",
        "c:-1",
        "c:+1",
        "c:1.0",
        "c: 1",
        "c:1 ",
        "c:1\n",
        "\nc:1",
        "../x",
        "../x:1",
        "a/b:1",
        "a:b:c",
        "a:1:2",
        "a:b:1",
        "a}:1",
        "{a}:1",
        "c:1}",
        "rstreamer:{other}:requests",
        "a b:1",
        "a*:1",
        "é:1",
        "c:٣",  # a digit, but not an ASCII one
        "c:" + "1" * 21,
        "a" * 65 + ":1",
    ],
    ids=repr,
)
def test_invalid_reply_token_is_refused(token):
    assert is_reply_token(token) is False
    with pytest.raises(ValueError):
        Keys("p").reply(token)


@pytest.mark.parametrize("token", [None, b"c:1", 1, ("c", 1)], ids=repr)
def test_non_str_reply_token_is_refused(token):
    assert is_reply_token(token) is False  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Keys("p").reply(token)  # type: ignore[arg-type]


# --- prefix_of_requests_key ----------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES)
def test_prefix_of_requests_key_roundtrips(prefix):
    assert prefix_of_requests_key(Keys(prefix).requests) == prefix


@pytest.mark.parametrize(
    "key",
    [
        "",
        "requests",
        "rstreamer:{a}:dead",
        "rstreamer:{a}:workers",
        "rstreamer:{a}:reply:c:1",
        "rstreamer:{a}:requests:x",
        "rstreamer:{a}:requests\n",
        "x:rstreamer:{a}:requests",
        "other:{a}:requests",
        "rstreamer:a:requests",
        "rstreamer:{}:requests",
        "rstreamer:{a:b}:requests",
        "rstreamer:{a}b}:requests",
        "rstreamer:{{a}}:requests",
        "rstreamer:{" + "x" * 101 + "}:requests",
    ],
    ids=repr,
)
def test_prefix_of_other_keys_is_none(key):
    assert prefix_of_requests_key(key) is None


def test_prefix_of_requests_key_of_other_keys_of_a_prefix_is_none():
    keys = Keys("p")
    for key in [keys.dead, keys.workers, keys.reply("c:1")]:
        assert prefix_of_requests_key(key) is None


# --- properties (hypothesis) ---------------------------------------------------------------

_FAST = settings(max_examples=100, deadline=None, database=None)
_prefix = st.from_regex(r"[A-Za-z0-9_.\-]{1,100}", fullmatch=True)
_token = st.from_regex(r"[A-Za-z0-9_.\-]{1,64}:[0-9]{1,20}", fullmatch=True)

@_FAST
@given(_prefix, _token)
def test_property_valid_prefix_and_token(prefix, token):
    keys = Keys(prefix)
    assert prefix_of_requests_key(keys.requests) == prefix
    for key in [keys.requests, keys.dead, keys.workers, keys.reply(token)]:
        assert key.startswith(f"rstreamer:{{{prefix}}}:")
        assert "::" not in key
        assert hash_tag(key) == prefix

@_FAST
@given(st.text(max_size=120))
def test_property_any_text_is_a_valid_prefix_or_a_config_error(text):
    try:
        prefix = validate_prefix(text)
    except ConfigError:
        return
    assert prefix == (text or "default")
    assert not set(prefix) & set("{}: \n*?[]")
    assert prefix_of_requests_key(Keys(prefix).requests) == prefix

@_FAST
@given(st.text(max_size=90))
def test_property_reply_key_never_escapes_its_prefix(text):
    keys = Keys("p")
    if not is_reply_token(text):
        with pytest.raises(ValueError):
            keys.reply(text)
        return
    key = keys.reply(text)
    assert hash_tag(key) == "p"
    assert key.count(":") == 5 and "::" not in key


def test_level_zero_is_the_requests_stream_of_old_clients_and_workers():
    keys = Keys("p")
    assert keys.requests_at(0) == keys.requests == "rstreamer:{p}:requests"
    assert keys.requests_at(1) == "rstreamer:{p}:requests:1"
    assert len({keys.requests_at(level) for level in range(16)}) == 16
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            keys.requests_at(bad)


# --- the names the docs and the Lua scripts rely on (found by mutation testing) -------------

JOB = "0123456789abcdef0123456789abcdef"


def test_job_tenant_and_token_keys_have_their_documented_names():
    keys = Keys("p")
    assert keys.job(JOB) == f"rstreamer:{{p}}:job:{JOB}"  # docs/jobs.md, "Keys"
    assert keys.job_inputs(JOB) == f"rstreamer:{{p}}:job:{JOB}:inputs"
    assert keys.job_results(JOB) == f"rstreamer:{{p}}:job:{JOB}:results"
    assert keys.job_log(JOB) == f"rstreamer:{{p}}:job:{JOB}:log"
    assert keys.bucket("acme.eu@x") == "rstreamer:{p}:bucket:acme.eu@x"
    assert keys.cancelled("c:1") == "rstreamer:{p}:cancelled:c:1"
    assert keys.stream_control("c:1") == "rstreamer:{p}:stream:c:1"
    assert keys.reply_head + "c:1" == keys.reply("c:1") == "rstreamer:{p}:reply:c:1"


@pytest.mark.parametrize(("build", "bad", "message"), [
    (Keys.job, "ABC", "invalid job id 'ABC'"),
    (Keys.job_inputs, JOB[:-1], "invalid job id"),
    (Keys.job_results, JOB + "0", "invalid job id"),
    (Keys.job_log, 42, "invalid job id 42"),
    (Keys.bucket, "no spaces", "invalid tenant 'no spaces'"),
    (Keys.bucket, 7, "invalid tenant 7"),
    (Keys.cancelled, "c:x", "invalid reply token 'c:x'"),
    (Keys.stream_control, "../c:1", "invalid reply token"),
    (Keys.requests_at, -1, "invalid priority level -1"),
])
def test_a_key_of_an_invalid_name_is_a_clear_error(build, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(Keys("p"), bad)


def test_job_tokens_name_their_job_and_nothing_else():
    assert job_of_token(f"job:{JOB}") == JOB
    assert job_of_token(JOB) is None and job_of_token(f"job:{JOB}x") is None and job_of_token(None) is None
    assert is_job_id(JOB) and not is_job_id(JOB.upper()) and not is_job_id(None)
    assert is_answer_token(f"job:{JOB}") and is_answer_token("c:1") and not is_answer_token("job:x")


def test_openai_store_keys_take_only_their_ids() -> None:
    keys = Keys("store")
    job = "0123456789abcdef0123456789abcdef"
    assert keys.openai_file("file-" + job) == "rstreamer:{store}:openai:file:file-" + job
    assert keys.openai_batches(None) == "rstreamer:{store}:openai:batches"
    assert keys.openai_batch("batch_" + job) == "rstreamer:{store}:openai:batch:batch_" + job
    assert keys.openai_batches("acme") == "rstreamer:{store}:openai:batches:acme"
    for bad in ("file-" + job + "x", "../x", "file-ABC", "", 1):
        with pytest.raises(ValueError):
            keys.openai_file(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        keys.openai_batch("file-" + job)
    with pytest.raises(ValueError):
        keys.openai_batches("a:b")
