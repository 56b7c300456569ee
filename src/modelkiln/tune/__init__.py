"""``kiln tune``: start ``kiln serve`` with each combination of settings, load-test each, rank them
against a latency budget, and write the best as a config file for ``kiln serve --config``."""
