"""`PrefillPoolView`: a decode replica's view of the prefill pool's KV sources, from the replicas' load reports.

Owns how a decode replica learns every prefill replica's KV source address without a request: it
holds a Serve handle to the prefill deployment only to have Serve's routing loop deliver that
deployment's replica list and load reports to this process (`router.replica_router`, the request
router Serve runs for that deployment's handles, publishes them on the board in `engine.load_report`,
as in the HTTP router); it never sends a request on the handle. `sources`
reads the board, so a prefill replica added, restarted or scaled away shows within one Serve
routing-stats period; the decode deployment polls it into `kv_transfer.KVPuller.keep_sources`.

Invariants: `sources` never blocks and never raises (an empty list until Serve's first update); the
handle is made once, in the constructor (a blocking call to the Serve controller, as a replica's
construction may make); outside a Serve application it is not made and `sources` stays empty.
"""

from __future__ import annotations

import logging

from engine.load_report import kv_sources, snapshot

log = logging.getLogger(__name__)

Source = tuple[str, int]


class PrefillPoolView:
    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self.watching = False
        try:
            import ray
            from ray import serve

            if not ray.is_initialized():
                raise RuntimeError("Ray is not running here")
            # options() initializes the handle's router: its long poll delivers the replicas' reports
            serve.get_deployment_handle(deployment).options()
            self.watching = True
        except Exception as e:  # no Serve here, or no such deployment: sources are met at first use
            log.warning("decode: cannot watch the %r deployment's KV sources (%s); each source will be met "
                        "at the first request naming it", deployment, e)

    def sources(self) -> list[Source]:
        """The KV sources of the prefill replicas Serve lists now (sorted)."""
        return kv_sources(snapshot(self.deployment).values())
