"""Redis plumbing: connections to any broker URL (single, Cluster, Sentinel, TLS) with retries,
the server clock every deadline is measured on, and the embedded redis-server of demos and tests.

May import: ``rstreamer.errors``, ``rstreamer.settings``.
"""
