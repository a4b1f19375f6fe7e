"""rstreamer: dynamic mini-batching between a web fleet and deep-learning models, over Redis Streams."""
from .batching.batcher import BatchPolicy
from .client.aio import AsyncRedisStreamer
from .client.future import Future
from .client.sync import RedisStreamer
from .codec.core import register_type
from .errors import (
    BatchSizeMismatch,
    BrokerUnavailable,
    CallTooLarge,
    Cancelled,
    CodecError,
    ConfigError,
    DeadLettered,
    DecodeError,
    EncodeError,
    InvalidInput,
    InvalidJobId,
    InvalidPriority,
    JobCancelled,
    JobNotFound,
    JobTooLarge,
    NoLiveWorker,
    Overloaded,
    RateLimited,
    RemoteError,
    RStreamerError,
    StreamerTimeout,
    WorkerStartupError,
)
from .jobs.core import JobItem, JobState, Progress
from .jobs.sync import Job
from .jobs.webhook_http import verify_webhook_signature
from .local import Streamer, ThreadedStreamer
from .model.generative import GenerativeModel, Step
from .model.managed import ManagedModel
from .settings import ClientSettings, JobSettings, WorkerSettings
from .version import VERSION
from .wire.chunks import Restarted
from .worker.loop import RedisWorker
from .worker.supervisor import run_redis_workers_forever

__version__ = VERSION

__all__ = [
    "AsyncRedisStreamer",
    "BatchPolicy",
    "BatchSizeMismatch",
    "BrokerUnavailable",
    "CallTooLarge",
    "Cancelled",
    "ClientSettings",
    "CodecError",
    "ConfigError",
    "DeadLettered",
    "DecodeError",
    "EncodeError",
    "Future",
    "GenerativeModel",
    "InvalidInput",
    "InvalidJobId",
    "InvalidPriority",
    "Job",
    "JobCancelled",
    "JobItem",
    "JobNotFound",
    "JobState",
    "JobTooLarge",
    "ManagedModel",
    "NoLiveWorker",
    "Overloaded",
    "Progress",
    "RateLimited",
    "RStreamerError",
    "RedisStreamer",
    "RedisWorker",
    "RemoteError",
    "Restarted",
    "Streamer",
    "Step",
    "StreamerTimeout",
    "ThreadedStreamer",
    "JobSettings",
    "WorkerSettings",
    "WorkerStartupError",
    "register_type",
    "run_redis_workers_forever",
    "verify_webhook_signature",
]
