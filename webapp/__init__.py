"""The rstreamer web front end: a Flask app for gunicorn/uwsgi and a Starlette app for uvicorn."""
