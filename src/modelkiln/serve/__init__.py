"""``kiln serve``: an Open Inference Protocol (KServe v2) server with dynamic batching.
See ``command.py`` (entry), ``app.py`` (routes), ``dataplane.py`` (logic), ``batcher.py``."""
