"""The WSGI entry point for servers that take a module attribute (uwsgi ``module = webapp.wsgi:app``).

Importing it builds the app; with uwsgi's ``lazy-apps`` that happens in each worker after the fork.
"""
from webapp.app import create_app

app = create_app()
