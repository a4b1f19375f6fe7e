"""Everything web and worker processes must agree on: key names (``keys``, the only key
formatter), request entries and admission (``messages``), replies (``replies``), streamed chunks
(``chunks``), withdrawals (``cancel``), what workers publish for others (``published``), and the
Lua scripts (``lua/*.lua``, loaded and registered by ``scripts``).

May import: ``errors``, ``settings``, ``model``, ``codec``, ``batching``, ``broker``.
"""
