"""Test support: the one home of everything the tests share that is not a test or a fixture.

One concept per module: `models` (tiny random models on disk), `markers` (skips for a missing
resource), fakes of the pools and of Serve handles, child processes for the KV transfer tests, local
Ray / Serve helpers. Test folders hold only ``test_*.py``, ``conftest.py`` (fixtures) and
``__init__.py``; no test module imports another (``tests/test_test_layout.py`` checks both).
"""
