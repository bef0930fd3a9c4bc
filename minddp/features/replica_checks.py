"""``check_sync_every=N``: every N-th synchronized forward, verify that all replicas are identical.

One small collective of checksums (:func:`minddp.replicas.check_replicas_in_sync`),
raising on every rank and naming the first tensor that differs. Skipped
inside ``join()`` while some rank has stopped training (its replica is
allowed to lag until the join ends).
"""

from __future__ import annotations

from minddp.features import Layer
from minddp.replicas import check_replicas_in_sync

__all__ = ["ReplicaChecks"]


class ReplicaChecks(Layer):
    height = 45

    def attach(self, module, every: int) -> None:
        self._checked_module, self._check_every = module, every
        self._synchronized_forwards = 0

    def prepare_for_forward(self, sync: bool, buffers_due: bool) -> int | None:
        source = super().prepare_for_forward(sync, buffers_due)
        if sync:
            if self._synchronized_forwards % self._check_every == 0:
                active = getattr(self, "join_active", None)  # minddp.features.uneven_inputs
                if active is None or all(active):
                    check_replicas_in_sync(self._checked_module, self.process_group)
            self._synchronized_forwards += 1
        return source
