"""The reply tokens of a streamer's calls (rstreamer.client.core.CallFactory): unique per call, and
a process forked from one that made calls (a gunicorn worker of a --preload master) makes its own,
never its parent's, so the two never read each other's reply keys."""
from __future__ import annotations

import os

from rstreamer.client.core import CallFactory


def factory() -> CallFactory:
    return CallFactory("redis://127.0.0.1:1/0", "tokens", None, None, None)


def test_each_call_has_its_own_token_and_reply_key():
    calls = factory()
    first, second = calls.new_call(["a"], None), calls.new_call(["b"], None)
    assert first.token != second.token
    assert first.reply_key == calls.keys.reply_head + first.token
    assert first.token.split(":")[0] == second.token.split(":")[0]  # one client id per process


def test_a_child_forked_after_calls_makes_tokens_of_another_client_id():
    calls = factory()
    parent_id = calls.new_call(["a"], None).token.split(":")[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next token, then leave at once
        try:
            os.write(write, calls.new_call(["b"], None).token.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child_token = os.read(read, 200).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert child_token, "the child made no token"
    assert child_token.split(":")[0] != parent_id
    assert calls.new_call(["c"], None).token.split(":")[0] == parent_id  # the parent keeps its own
