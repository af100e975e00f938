"""Plain helpers the tests share: no tests and no fixtures here (fixtures live in the conftest.py files)."""
