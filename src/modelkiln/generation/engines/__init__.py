"""The engines behind the engine core's seam (``plan.py``): a registry keyed by the variant's ``engine``,
one folder per engine."""
