"""The OpenAI Batch API's Redis side: files and batches under the ``openai_store`` prefix's hash
tag (keys from rstreamer.wire.keys, every one with the files' TTL), and each batch's durable job
on its model's prefix. Sync: the Flask app calls it directly, the Starlette app in a thread (files
and batches are the control plane, not the path of every token).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rstreamer.broker.connection import RedisClient, broker_errors
from rstreamer.errors import JobNotFound
from rstreamer.jobs.core import PAGE, JobInfo, JobItem, JobState
from rstreamer.jobs.sync import JobClient
from rstreamer.wire.keys import Keys, is_batch_id, is_file_id

from . import batches
from .config import OpenAIConfig
from .errors import OpenAIError, bad_request, not_found

MAX_LIST = 100
DEFAULT_LIST = 20


class BatchStore:
    """Files and batches of the OpenAI Batch API for one web process.

    ``owner``, in every method, is the tenant of the request's API key (None without keys): a
    file or batch is visible to its owner alone (another's is a 404).
    """

    def __init__(self, client: RedisClient, url: str, config: OpenAIConfig, max_item_bytes: int,
                 max_queue: int = 0) -> None:
        self.redis: Any = client  # redis-py types its replies loosely
        self.url = url
        self.config = config
        self.max_item_bytes = max_item_bytes
        self.max_queue = max_queue  # the bound of a job's level when the workers publish none
        self.keys = Keys(config.openai_store)
        self.ttl_ms = int(config.openai_file_ttl * 1000)
        self._jobs: dict[str, JobClient] = {}

    def jobs(self, prefix: str) -> JobClient:
        """The job client of a model's prefix."""
        client = self._jobs.get(prefix)
        if client is None:
            client = self._jobs[prefix] = JobClient(self.redis, Keys(prefix), self.url, self.max_item_bytes,
                                                    max_queue=self.max_queue)
        return client

    # files ------------------------------------------------------------------------------------

    def upload(self, owner: str | None, purpose: str | None, filename: str | None, content: bytes) -> dict[str, Any]:
        """``POST /v1/files``: store a batch input file; its ``file`` object."""
        name = batches.check_upload(purpose, filename, content, self.config.openai_file_max_bytes)
        return self._put_file(owner, batches.new_file_id(), name, "batch", bytes(content))

    def _put_file(self, owner: str | None, file_id: str, name: str, purpose: str, content: bytes,
                  pipe: Any = None) -> dict[str, Any]:
        created = batches.now()
        document = batches.file_object(file_id, len(content), name, purpose, created,
                                       created + int(self.config.openai_file_ttl))
        own = pipe is None
        pipe = pipe if pipe is not None else self.redis.pipeline(transaction=True)
        key = self.keys.openai_file(file_id)
        pipe.hset(key, mapping={"meta": json.dumps({**document, "owner": owner}), "content": content})
        pipe.pexpire(key, self.ttl_ms)
        if own:
            with broker_errors(self.url):
                pipe.execute()
        return document

    def file(self, owner: str | None, file_id: str) -> dict[str, Any]:
        """``GET /v1/files/{id}``: the ``file`` object; a 404 for an unknown (or another's) file."""
        if not is_file_id(file_id):
            raise not_found(f"No such File object: {file_id}", "file_not_found", "file_id")
        with broker_errors(self.url):
            raw = self.redis.hget(self.keys.openai_file(file_id), "meta")
        document = json.loads(raw) if raw else None
        if document is None or document.pop("owner", None) != owner:
            raise not_found(f"No such File object: {file_id}", "file_not_found", "file_id")
        return dict(document)

    def content(self, owner: str | None, file_id: str) -> bytes:
        """``GET /v1/files/{id}/content``: the file's bytes."""
        self.file(owner, file_id)
        with broker_errors(self.url):
            content = self.redis.hget(self.keys.openai_file(file_id), "content")
        if content is None:
            raise not_found(f"No such File object: {file_id}", "file_not_found", "file_id")
        return bytes(content)

    def delete_file(self, owner: str | None, file_id: str) -> dict[str, Any]:
        """``DELETE /v1/files/{id}``."""
        self.file(owner, file_id)
        with broker_errors(self.url):
            self.redis.delete(self.keys.openai_file(file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    # batches ----------------------------------------------------------------------------------

    def create(self, owner: str | None, document: dict[str, Any], resolve: Callable[[str], str]) -> dict[str, Any]:
        """``POST /v1/batches``: check every line, submit them as one job; a batch whose lines
        (or model) are wrong is stored as ``failed`` with the errors listed, as OpenAI's is."""
        request = batches.batch_request(document)
        lines = batches.parse_lines(self.content(owner, request.input_file_id), request.endpoint)
        created = batches.now()
        record: dict[str, Any] = {"id": batches.new_batch_id(), "owner": owner, "endpoint": request.endpoint,
                  "input_file_id": request.input_file_id, "created_at": created,
                  "expires_at": created + 24 * 3600, "metadata": request.metadata, "model": lines.model,
                  "total": len(lines.custom_ids)}
        if not lines.errors:
            try:
                record["prefix"] = resolve(str(lines.model))
            except OpenAIError as exc:
                lines.errors.append({"code": exc.code, "message": exc.message, "param": "body.model", "line": None})
        if lines.errors:
            return self._store_failed(record, lines.errors)
        # The least urgent level (priority None): batches fill the capacity interactive calls leave.
        # The owner's quota and fair share apply as the items are fed (a tenant of None: none).
        job = self.jobs(record["prefix"]).submit(lines.items, ttl=self.config.openai_file_ttl,
                                                 meta={"openai_batch": record["id"]}, tenant=owner)
        record.update(job_id=job.id, in_progress_at=created)
        fields = {"record": json.dumps(record), "custom_ids": json.dumps(lines.custom_ids)}
        if any(lines.base64):
            fields["base64"] = json.dumps(lines.base64)
        self._store(record, fields)
        return batches.batch_object(record, "in_progress", _counts(record["total"], 0, 0))

    def _store(self, record: dict[str, Any], fields: dict[str, str]) -> None:
        key, index = self.keys.openai_batch(record["id"]), self.keys.openai_batches(record["owner"])
        with broker_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self.ttl_ms)
            pipe.zadd(index, {record["id"]: record["created_at"] * 1000})
            pipe.pexpire(index, self.ttl_ms)
            pipe.execute()

    def _store_failed(self, record: dict[str, Any], errors: list[dict[str, Any]]) -> dict[str, Any]:
        failure = {"errors": {"object": "list", "data": errors[:100]}, "failed_at": record["created_at"]}
        self._store(record, {"record": json.dumps(record), "failed": json.dumps(failure)})
        return batches.batch_object(record, "failed", _counts(record["total"], 0, 0), **failure)

    def _fields(self, owner: str | None, batch_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The batch's record and stored fields; a 404 for an unknown (or another's) batch."""
        fields = {}
        if is_batch_id(batch_id):
            with broker_errors(self.url):
                fields = {k.decode(): v for k, v in self.redis.hgetall(self.keys.openai_batch(batch_id)).items()}
        record = json.loads(fields["record"]) if "record" in fields else None
        if record is None or record.get("owner") != owner:
            raise not_found(f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")
        return record, fields

    def get(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        """``GET /v1/batches/{id}``: the batch now; a batch whose job has finished gets its
        output and error files on the way."""
        record, fields = self._fields(owner, batch_id)
        if "failed" in fields:
            return batches.batch_object(record, "failed", _counts(record["total"], 0, 0),
                                        **json.loads(fields["failed"]))
        if "outcome" in fields:
            return _finished(record, json.loads(fields["outcome"]))
        cancelling = int(fields["cancelling_at"]) if "cancelling_at" in fields else None
        try:
            info = self.jobs(record["prefix"]).get(record["job_id"]).info()
        except JobNotFound:  # the job's TTL passed: its answers are gone with it
            return self._finalize(record, fields, None, cancelling)
        if info.state.finished:
            return self._finalize(record, fields, info, cancelling)
        return batches.batch_object(record, "cancelling" if cancelling else "in_progress",
                                    _counts(record["total"], info.progress.done, info.progress.failed),
                                    cancelling_at=cancelling)

    def _finalize(self, record: dict[str, Any], fields: dict[str, Any], info: JobInfo | None,
                  cancelling: int | None) -> dict[str, Any]:
        """Write the output and error files of a finished job and record the batch's outcome."""
        answers = self._answers(record, info) if info is not None else {}
        status = ("expired" if info is None else
                  "cancelled" if info.state is JobState.CANCELLED else "completed")
        outputs = batches.build_outputs(record["endpoint"], record["model"], json.loads(fields["custom_ids"]),
                                        json.loads(fields.get("base64", "[]")), answers, "batch_" + status)
        finished = batches.now()
        outcome: dict[str, Any] = {"status": status, "finished_at": finished, "cancelling_at": cancelling,
                                   "completed": outputs.completed, "failed": outputs.failed,
                                   "output_file_id": None, "error_file_id": None}
        with broker_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            for which, content in (("output", outputs.output), ("error", outputs.errors)):
                if content:
                    file_id = batches.derived_file_id(record["id"], which)
                    self._put_file(record["owner"], file_id, f"{record['id']}_{which}.jsonl", "batch_output",
                                   bytes(content), pipe)
                    outcome[f"{which}_file_id"] = file_id
            key = self.keys.openai_batch(record["id"])
            pipe.hset(key, "outcome", json.dumps(outcome))
            pipe.pexpire(key, self.ttl_ms)  # the batch lives as long as its files
            pipe.execute()
        return _finished(record, outcome)

    def _answers(self, record: dict[str, Any], info: JobInfo) -> dict[int, JobItem]:
        job = self.jobs(record["prefix"]).get(info.id)
        answers: dict[int, JobItem] = {}
        for start in range(0, info.progress.total, PAGE):
            answers.update((item.index, item) for item in job.results_page(start, PAGE))
        return answers

    def cancel(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        """``POST /v1/batches/{id}/cancel``: no request not started yet runs; the batch is then
        ``cancelled``, its output file holding what was answered."""
        record, fields = self._fields(owner, batch_id)
        if "failed" not in fields and "outcome" not in fields:
            with broker_errors(self.url):
                self.redis.hsetnx(self.keys.openai_batch(batch_id), "cancelling_at", batches.now())
            try:
                self.jobs(record["prefix"]).get(record["job_id"]).cancel()
            except JobNotFound:
                pass  # expired: get() says so
        return self.get(owner, batch_id)

    def list(self, owner: str | None, after: str | None, limit: int) -> dict[str, Any]:
        """``GET /v1/batches``: the owner's batches, newest first, ``limit`` after the id ``after``."""
        index = self.keys.openai_batches(owner)
        with broker_errors(self.url):
            self.redis.zremrangebyscore(index, "-inf", batches.now() * 1000 - self.ttl_ms)
            start = 0
            if after:
                rank = self.redis.zrevrank(index, after)
                if rank is None:
                    raise bad_request(f"'after' names no batch of yours: {after}", "after")
                start = int(rank) + 1
            ids = [raw.decode() for raw in self.redis.zrevrange(index, start, start + limit)]
        data = []
        for batch_id in ids[:limit]:
            try:
                data.append(self.get(owner, batch_id))
            except OpenAIError:
                continue  # expired between the two reads
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}


def list_limit(raw: str | None) -> int:
    """The ``limit`` of ``GET /v1/batches`` (1-100, default 20)."""
    if raw in (None, ""):
        return DEFAULT_LIST
    try:
        value = int(str(raw))
    except ValueError:
        raise bad_request(f"'limit' must be an integer, got {raw!r}", "limit") from None
    if not 1 <= value <= MAX_LIST:
        raise bad_request(f"'limit' must be between 1 and {MAX_LIST}, got {value}", "limit")
    return value


def _counts(total: int, completed: int, failed: int) -> dict[str, int]:
    return {"total": total, "completed": completed, "failed": failed}


def _finished(record: dict[str, Any], outcome: dict[str, Any]) -> dict[str, Any]:
    status, at = outcome["status"], outcome["finished_at"]
    times = {"completed": {"finalizing_at": at, "completed_at": at}, "cancelled": {"cancelled_at": at},
             "expired": {"expired_at": at}}[status]
    return batches.batch_object(record, status, _counts(record["total"], outcome["completed"], outcome["failed"]),
                                output_file_id=outcome["output_file_id"], error_file_id=outcome["error_file_id"],
                                cancelling_at=outcome.get("cancelling_at"), **times)
