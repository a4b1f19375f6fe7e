"""Durable jobs, both halves: the sans-I/O core (ids, encoding, submissions), the sync and async
clients (``sync``, ``aio``), the worker's job sink (``sink``) and webhook sender (``webhooks``,
with one try of a call in ``webhook_http`` and the targets a webhook may reach in
``webhook_targets``).

May import: ``errors``, ``settings``, ``codec``, ``batching``, ``broker``, ``wire``.
``rstreamer.jobs.JobClient`` keeps the path it had before this became a package.
"""
from .sync import Job, JobClient, JobInfo, JobItem, JobState, Progress

__all__ = ["Job", "JobClient", "JobInfo", "JobItem", "JobState", "Progress"]
