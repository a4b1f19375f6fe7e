"""OpenAI's API under ``/v1`` for both web apps (docs/openai.md).

Written once here: parsing requests (:mod:`.requests`), building responses and stream chunks
(:mod:`.responses`, :mod:`.streaming`), errors and retry headers (:mod:`.errors`), model names
(:mod:`.models`), API keys (:mod:`.auth`), settings (:mod:`.config`), the Batch API
(:mod:`.batches`, :mod:`.store`), and what a web process holds (:mod:`.service`). Each app does
its I/O only: :mod:`.wsgi_routes` for Flask, :mod:`.asgi_routes` for Starlette.
"""
