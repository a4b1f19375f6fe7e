"""rstreamer: dynamic mini-batching between a web fleet and deep-learning models, over Redis Streams."""
from .aclient import AsyncRedisStreamer
from .batching import BatchPolicy
from .chunks import Restarted
from .client import RedisStreamer
from .codec import register_type
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
from .future import Future
from .generative import GenerativeModel, Step
from .jobs import Job, JobItem, JobState, Progress
from .local import Streamer, ThreadedStreamer
from .model import ManagedModel
from .settings import ClientSettings, JobSettings, WorkerSettings
from .supervisor import run_redis_workers_forever
from .version import VERSION
from .worker import RedisWorker

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
]
