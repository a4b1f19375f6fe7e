"""The Flask app's request bodies, bounded as the Starlette app's are (:mod:`webapp.asgi_io`).

Flask's ``MAX_CONTENT_LENGTH`` refuses a body whose Content-Length exceeds it, but a chunked body
(no Content-Length) is only cut there: Werkzeug 3.1 reads the first ``MAX_CONTENT_LENGTH`` bytes
as if they were the whole body, and a call ran on truncated inputs and answered 200. So the app's
Werkzeug limit is one byte more than its own (:func:`configure`), and a body that reaches it is
refused here with 413.
"""
from __future__ import annotations

from flask import Flask, Request, current_app
from werkzeug.exceptions import RequestEntityTooLarge

from . import protocol

_LIMIT = "RSTREAMER_MAX_BODY"


def configure(app: Flask, max_body: int) -> None:
    """Refuse request bodies over ``max_body`` bytes on ``app`` (see the module)."""
    app.config[_LIMIT] = max_body
    app.config["MAX_CONTENT_LENGTH"] = max_body + 1


def read_body(request: Request) -> bytes:
    """The request's body, refused (413) over the app's limit, whether or not it declared its length."""
    limit = int(current_app.config[_LIMIT])
    try:
        body = request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise protocol.too_large(limit) from None
    if len(body) > limit:
        raise protocol.too_large(limit)
    return body
