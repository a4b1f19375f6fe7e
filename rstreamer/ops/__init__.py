"""What operators and observers read: the observer protocol (``hooks``), Prometheus metrics,
OpenTelemetry tracing, logging set-up, ``rstreamer status``, dead letters, the admin commands
(``jobs``, ``dead``) and the live dashboard.

May import: everything below the client and the worker (``wire``, ``jobs``, ``broker``, ...).
"""
