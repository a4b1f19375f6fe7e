"""The face of the library: ``rstreamer.__all__`` is pinned, and every name in it is importable.

A name added to or removed from the public API is a decision, not a side effect of a move: change
this list with it (and the docs).
"""
import importlib

import rstreamer

PUBLIC = [
    "AsyncRedisStreamer", "BatchPolicy", "BatchSizeMismatch", "BrokerUnavailable", "CallTooLarge", "Cancelled",
    "ClientSettings", "CodecError", "ConfigError", "DeadLettered", "DecodeError", "EncodeError", "Future",
    "GenerativeModel", "InvalidInput", "InvalidJobId", "InvalidPriority", "Job", "JobCancelled", "JobItem",
    "JobNotFound",
    "JobSettings", "JobState", "JobTooLarge", "ManagedModel", "NoLiveWorker", "Overloaded", "Progress",
    "RStreamerError", "RateLimited", "RedisStreamer", "RedisWorker", "RemoteError", "Restarted", "Step",
    "Streamer", "StreamerTimeout", "ThreadedStreamer", "WorkerSettings", "WorkerStartupError", "register_type",
    "run_redis_workers_forever", "verify_webhook_signature",
]


def test_all_is_pinned():
    assert sorted(rstreamer.__all__) == sorted(PUBLIC)
    assert len(set(rstreamer.__all__)) == len(rstreamer.__all__)


def test_every_public_name_is_importable_from_the_face():
    for name in rstreamer.__all__:
        assert getattr(rstreamer, name) is not None, name


def test_the_paths_of_the_old_flat_modules_that_docs_name_still_work():
    # rstreamer.model, .codec, .jobs, .client and .worker became packages that re-export what they held.
    paths = {
        "rstreamer.model": ["ManagedModel", "GenerativeModel"],
        "rstreamer.codec": ["register_type", "packb", "unpackb"],
        "rstreamer.jobs": ["JobClient", "Job"],
        "rstreamer.client": ["RedisStreamer"],
        "rstreamer.worker": ["RedisWorker"],
        "rstreamer.batching": ["Batcher", "BatchPolicy"],
    }
    for module, names in paths.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module}.{name}"
