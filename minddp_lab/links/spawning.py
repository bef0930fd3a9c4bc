""":func:`spawn` with real shaped links: each rank in a network namespace of its own.

The library's :func:`minddp.launch.spawn` runs a setup of each rank's before
its process group (``rank_setup``); here that setup enters the rank's seat of
a network built by :func:`minddp_lab.links.namespaces.shaped_network`.
"""

from __future__ import annotations

import functools
from typing import Callable

from minddp.launch import spawn as spawn_on_loopback
from minddp_lab.links.namespaces import Seat, enter, shaped_network

__all__ = ["spawn"]


def _enter_seat(seats: list[Seat], rank: int) -> None:
    enter(seats[rank])


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    start_method: str = "spawn",
    link: str | None = None,
) -> None:
    """:func:`minddp.launch.spawn`, behind a real link when ``link`` names a rate.

    ``link="1gbit"`` (any rate :func:`minddp_lab.links.namespaces.parse_rate`
    accepts): each rank runs in a network namespace of its own, joined to the
    others by links shaped to that rate, so that Gloo's traffic crosses a
    real, rate-limited network instead of loopback. The namespaces are
    removed when the ranks end, however they end. Needs root. ``None`` or
    ``"loopback"``: the library's spawn as it is.
    """
    if link is None or link == "loopback":
        return spawn_on_loopback(fn, world_size, *args, backend=backend, start_method=start_method)
    with shaped_network(world_size, link) as net:
        seats = [net.seat(r) for r in range(world_size)]
        return spawn_on_loopback(fn, world_size, *args, backend=backend, start_method=start_method,
                                 rank_setup=functools.partial(_enter_seat, seats))
