"""The Triton python-backend models, as real Python files. ``repository.py`` copies each one to
``<model>/1/model.py`` next to a snapshot of the modelkiln package; they are never imported here."""
