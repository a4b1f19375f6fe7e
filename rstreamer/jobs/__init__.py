"""Durable jobs, both halves: the sans-I/O core (``core``: ids, encoding, submissions, parsing),
the exchanges with Redis written once as flows (``flows``), run by the sync and async clients
(``sync``, ``aio``: thin shells), the worker's job sink (``sink``) and webhook sender (``webhooks``,
with one try of a call in ``webhook_http`` and the targets a webhook may reach in
``webhook_targets``).

May import: ``errors``, ``settings``, ``codec``, ``batching``, ``broker``, ``wire``.
``rstreamer.jobs.JobClient`` keeps the path it had before this became a package.
"""
from .core import JobInfo, JobItem, JobState, Progress
from .sync import Job, JobClient

__all__ = ["Job", "JobClient", "JobInfo", "JobItem", "JobState", "Progress"]
