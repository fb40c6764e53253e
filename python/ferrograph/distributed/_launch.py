"""Starting a :class:`~ferrograph.distributed.Cluster`: :func:`launch` and its checks."""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._server_process import default_server_command
from ..errors import Error, InvalidArgumentError
from ._cluster import Cluster, ServerState
from ._host import ServerHost
from ._ray import (
    LaunchError,
    actor_failure,
    import_ray,
    keep_ray_on_loopback,
    start_ray,
    stop_ray,
)

logger = logging.getLogger("ferrograph.distributed")

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
"""Placement strategies Ray accepts for the servers' placement group."""


def check_launch_args(
    n_servers: int,
    cpus_per_server: float,
    strategy: str,
    max_restarts: int,
    ready_timeout: float,
    monitor_interval: float,
) -> None:
    if isinstance(n_servers, bool) or not isinstance(n_servers, int) or n_servers < 1:
        raise InvalidArgumentError(f"n_servers must be a positive int, got {n_servers!r}")
    if (
        isinstance(cpus_per_server, bool)
        or not isinstance(cpus_per_server, (int, float))
        or not cpus_per_server > 0
    ):
        raise InvalidArgumentError(
            f"cpus_per_server must be a positive number, got {cpus_per_server!r}"
        )
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise InvalidArgumentError(
            f"max_restarts must be an int >= 0 (or -1: no limit), got {max_restarts!r}"
        )
    for name, value in (("ready_timeout", ready_timeout), ("monitor_interval", monitor_interval)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidArgumentError(
                f"{name} must be a positive number of seconds, got {value!r}"
            )


def launch(
    n_servers: int,
    cpus_per_server: float = 1,
    strategy: str = "SPREAD",
    address: str | None = None,
    max_restarts: int = 0,
    *,
    host: str | None = None,
    threads: int | None = None,
    server_command: Sequence[str] | None = None,
    ready_timeout: float = 60.0,
    monitor_interval: float = 0.2,
    on_lost: Callable[[ServerState], None] | None = None,
) -> Cluster:
    """Starts ``n_servers`` device servers as Ray actors and connects their devices.

    Parameters
    ----------
    n_servers
        How many servers (one placement-group bundle and one actor each).
    cpus_per_server
        CPUs reserved per server; the server's CPU backend uses that many threads unless
        ``threads`` says otherwise.
    strategy
        The placement group's strategy: ``"SPREAD"`` (default), ``"STRICT_SPREAD"`` (every
        server on its own node), ``"PACK"`` or ``"STRICT_PACK"``.
    address
        A Ray cluster to join (``"auto"``, ``"host:port"``, ``"ray://..."``). ``None``: the one
        this process is connected to, else a new local Ray on loopback (stopped by
        :meth:`Cluster.shutdown`).
    max_restarts
        How many times Ray may restart each server after it dies (``-1``: no limit).
    host
        The address servers bind; default: their node's address as Ray knows it (127.0.0.1
        for a local Ray).
    server_command
        The server's command line before its options; default
        :func:`default_server_command` (``python -m ferrograph serve`` with this interpreter:
        the nodes need ferrograph installed in the same environment).
    ready_timeout
        Seconds to wait for the placement group, each server and each connection.
    monitor_interval
        Seconds between the monitor's pings of each actor.
    on_lost
        Called from the monitor thread with the server's state when a server is lost.

    Raises
    ------
    RayNotInstalledError
        If ``ray`` is not importable.
    LaunchError
        If the servers cannot be placed, started or connected within ``ready_timeout``.
    ferrograph.InvalidArgumentError
        For a bad argument.
    """
    check_launch_args(
        n_servers, cpus_per_server, strategy, max_restarts, ready_timeout, monitor_interval
    )
    if threads is None:
        threads = max(1, int(cpus_per_server))
    if address is None and "ray" not in sys.modules:
        keep_ray_on_loopback()  # before Ray reads its settings at import
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    start = time.perf_counter()
    owns_ray = start_ray(ray, address, n_servers * cpus_per_server)
    token = secrets.token_hex(32)
    command = list(server_command) if server_command is not None else default_server_command()
    pg = placement_group(
        [{"CPU": float(cpus_per_server)} for _ in range(n_servers)],
        strategy=strategy,
        name=f"ferrograph-{secrets.token_hex(4)}",
    )
    actors: list[Any] = []
    cluster: Cluster | None = None
    try:
        try:
            ray.get(pg.ready(), timeout=ready_timeout)
        except ray.exceptions.GetTimeoutError:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            cpus = [n.get("Resources", {}).get("CPU", 0) for n in nodes]
            raise LaunchError(
                f"Ray could not place {n_servers} server(s) of {cpus_per_server} CPU(s) with "
                f"{strategy} within {ready_timeout:.0f} s: the cluster has {len(nodes)} "
                f"node(s) with {cpus} CPUs"
            ) from None
        server_cls = ray.remote(ServerHost)
        for i in range(n_servers):
            actors.append(
                server_cls.options(
                    num_cpus=cpus_per_server,
                    max_restarts=max_restarts,
                    max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=i
                    ),
                ).remote(token, host, threads, command, ready_timeout)
            )
        cluster = Cluster(
            ray,
            pg,
            actors,
            token,
            strategy,
            cpus_per_server,
            max_restarts,
            owns_ray,
            monitor_interval,
            ready_timeout,
        )
        for i in range(n_servers):
            try:
                cluster._connect(i, ready_timeout)
            except Error:
                raise
            except Exception as error:
                raise LaunchError(f"server {i}: {actor_failure(error)}") from error
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        else:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            if owns_ray:
                stop_ray(ray)
        raise
    cluster._on_lost = on_lost
    cluster._start_monitor()
    logger.info(
        "launched %d server(s) (%s) in %.2f s: %s",
        n_servers,
        strategy,
        time.perf_counter() - start,
        cluster.endpoints,
    )
    return cluster
