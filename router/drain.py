"""The app-wide drain flag: while it is set, every router replica answers ``/ready`` with 503.

Owns: one boolean per Serve application, kept in Ray's internal key-value store (the GCS), so the
operator's side (`cluster.drain`, ``pdserve drain``, SIGTERM of ``pdserve serve``) sets it once and
every router replica, on any node, sees it. A load balancer that health-checks ``/ready`` takes the
app out of rotation *first*; the routers go on serving what still arrives, and the drain waits for
the pools to empty before anything is stopped.

Invariants: reading never raises (outside Ray, or if the GCS does not answer, the app is not
draining: a broken store must not take a healthy app out of rotation); a reader sees a change
within ``cache_s``; the flag lives in its own namespace and never outlives the Ray cluster.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"


def _key(app_name: str) -> bytes:
    return f"draining/{app_name}".encode()


def set_draining(app_name: str, draining: bool) -> None:
    """Set or clear the flag (the caller must be connected to the Ray cluster)."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    if draining:
        _internal_kv_put(_key(app_name), b"1", overwrite=True, namespace=NAMESPACE)
    else:
        _internal_kv_del(_key(app_name), namespace=NAMESPACE)


def read_draining(app_name: str) -> bool:
    """The flag as stored now; False when it cannot be read."""
    try:
        import ray
        from ray.experimental.internal_kv import _internal_kv_get

        if not ray.is_initialized():
            return False
        return _internal_kv_get(_key(app_name), namespace=NAMESPACE) == b"1"
    except Exception:  # the store is down or Ray is shutting down: do not flap readiness
        log.warning("could not read the drain flag of %r", app_name, exc_info=True)
        return False


class DrainFlag:
    """A router replica's cached view of its app's flag (at most one store read per ``cache_s``)."""

    def __init__(self, app_name: str, cache_s: float = 0.5) -> None:
        self.app_name = app_name
        self.cache_s = cache_s
        self._value = False
        self._read_at = float("-inf")

    def is_set(self) -> bool:
        now = time.monotonic()
        if now - self._read_at >= self.cache_s:
            self._value = read_draining(self.app_name)
            self._read_at = now
        return self._value


def current_app_name(default: str = "pdserve") -> str:
    """The Serve application this replica belongs to (``default`` outside a replica)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().app_name)
    except Exception:
        return default
