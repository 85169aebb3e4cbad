"""The e2e package's one local Ray Serve: started by the first module that asks for it, shared by every
module after it, stopped when the package ends.

Each module deploys its own apps under its own route prefixes (`tests.support.serve_harness.deploy`)
and deletes them when it is done, so no module sees another's replicas; only the Ray start, the Serve
controller and the HTTP proxy are shared. ``address="local"`` always starts a fresh cluster: never one
somebody else started on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package")
def serve_base() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a Serve proxy on a Ray cluster of this package's own."""
    from tests.support import pd_fakes
    from tests.support.serve_harness import local_serve

    with local_serve(pd_fakes) as base:
        yield base
