"""What operators and observers read: the observer protocol (``hooks``), Prometheus metrics, a
worker's measured pace and the expected drain time (``pace``), OpenTelemetry tracing, logging
set-up, ``rstreamer status``, dead letters, the admin commands (``jobs``, ``dead``), the queue
exporter and the live dashboard.

May import: everything below the client and the worker (``wire``, ``jobs``, ``broker``, ...).
"""
