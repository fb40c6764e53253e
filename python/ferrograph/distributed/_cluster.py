"""The driver side of :mod:`ferrograph.distributed`: :class:`Cluster` (the connected servers,
their monitor and shutdown) and :class:`ServerState` (one server as the driver knows it)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendError
from ..remote import RemoteConnection, open_connection
from ._ray import actor_failure, first_line, stop_ray

logger = logging.getLogger("ferrograph.distributed")

CACHED_WRITE_MIN = 1 << 20
"""Tensor writes of at least this many bytes go through a server's weight cache (the remote
client's threshold)."""


def _close(connection: RemoteConnection) -> None:
    """Closes a server's client connection, so its devices fail at once; never raises (the
    monitor must not die on it)."""
    try:
        connection.close()
    except Exception:
        logger.debug("closing the connection to %s failed", connection.endpoint, exc_info=True)


@dataclass
class ServerState:
    """One server of a :class:`Cluster`, as the driver knows it."""

    index: int
    """Bundle index in the placement group."""
    endpoint: str = ""
    """``host:port`` of the current incarnation."""
    node_id: str = ""
    node_ip: str = ""
    pid: int = 0
    """The server process id on its node."""
    actor_pid: int = 0
    """The actor's process id on its node."""
    incarnation: str = ""
    state: str = "starting"
    """``"starting"``, ``"alive"``, ``"lost"`` (actor dead, maybe restarting) or ``"stopped"``."""
    lost_reason: str | None = None
    restarts: int = 0
    """How many times the monitor reconnected to a restarted server."""
    connection: RemoteConnection | None = None
    """The client connection to it (:func:`ferrograph.remote.open_connection`); closed, and
    set to ``None``, when the server is lost or the cluster shut down."""
    devices: list[Any] = field(default_factory=list)
    lost_at: float | None = None
    """``time.monotonic()`` when the monitor saw the actor die."""


class Cluster:
    """Device servers placed by Ray, connected and supervised (made by :func:`launch`).

    Use it as a context manager or call :meth:`shutdown`. :attr:`devices` are the connected
    remote devices of every server, in bundle order.
    """

    def __init__(
        self,
        ray: Any,
        placement_group: Any,
        actors: list[Any],
        token: str,
        strategy: str,
        cpus_per_server: float,
        max_restarts: int,
        owns_ray: bool,
        monitor_interval: float,
        ready_timeout: float,
    ) -> None:
        self._ray = ray
        self.placement_group = placement_group
        self._actors = actors
        self.__token = token
        self.strategy = strategy
        self.cpus_per_server = cpus_per_server
        self.max_restarts = max_restarts
        self.owns_ray = owns_ray
        self.monitor_interval = monitor_interval
        self.ready_timeout = ready_timeout
        self.servers = [ServerState(i) for i in range(len(actors))]
        self.generation = 0
        """Bumped whenever a server is lost or reconnected (the device list changed)."""
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._closed = False
        self._on_lost: Callable[[ServerState], None] | None = None

    # ----- public -----

    @property
    def devices(self) -> list[Any]:
        """The remote devices of the servers that are alive, in bundle order."""
        with self._lock:
            return [d for s in self.servers if s.state == "alive" for d in s.devices]

    @property
    def devices_per_server(self) -> list[list[Any]]:
        """The devices of each server, in bundle order (empty for a server that is lost)."""
        with self._lock:
            return [list(s.devices) if s.state == "alive" else [] for s in self.servers]

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of each server (in bundle order)."""
        with self._lock:
            return [s.endpoint for s in self.servers]

    @property
    def node_ids(self) -> list[str]:
        """The Ray node id each server runs on (in bundle order)."""
        with self._lock:
            return [s.node_id for s in self.servers]

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles (in bundle order)."""
        return list(self._actors)

    def backends(self, **options: Any) -> list[Any]:
        """One backend per device (``device.init_backend(**options)``), ready for
        ``fg.Scheduler``."""
        return [d.init_backend(**options) for d in self.devices]

    def preload_weights(self, tensors: Any, min_bytes: int = CACHED_WRITE_MIN) -> int:
        """Places weights in every server's weight cache through Ray's object store, so a
        client's later upload of the same bytes sends only their hashes.

        ``tensors``: a :class:`ferrograph.models.SentenceEncoder` (its encoder layers'
        weights, as they will be uploaded), a mapping of names to ``fg.Tensor`` or a sequence
        of tensors. Only tensors of at least ``min_bytes`` (the client's threshold for cached
        writes) are sent. The bytes are put in the object store once; each server's actor
        reads them there (zero-copy on its node, one transfer per node) and writes them to its
        server over loopback. Returns the bytes each server received.

        Raises :class:`ferrograph.BackendError` when a server fails to take them (or does not
        within ``ready_timeout``).

        Not the default: on one machine a direct upload from the client is as fast or faster
        (``benches/cluster.py`` measures both); across machines it spares the client's own
        link from sending the weights once per server.
        """
        import numpy as np

        import ferrograph as fg

        if hasattr(tensors, "weights"):  # a model: the layers that go to servers
            items = [t for n, t in tensors.weights.items() if n.startswith("encoder.layer.")]
        elif isinstance(tensors, dict):
            items = list(tensors.values())
        else:
            items = list(tensors)
        blobs = []
        for tensor in items:
            if tensor.nbytes >= min_bytes:
                blobs.append(np.frombuffer(fg.tensor_get(tensor), np.uint8))
        if not blobs:
            return 0
        ray = self._ray
        ref = ray.put(blobs)
        with self._lock:
            alive = [i for i, s in enumerate(self.servers) if s.state == "alive"]
        try:
            sizes = ray.get(
                [self._actors[i].warm_cache.remote([ref]) for i in alive],
                timeout=self.ready_timeout,
            )
        except Exception as error:
            raise BackendError(f"preloading weights failed: {actor_failure(error)}") from error
        logger.info(
            "weights through the object store: %d tensor(s), %.1f MiB to %d server(s)",
            len(blobs),
            sizes[0] / 2**20 if sizes else 0.0,
            len(sizes),
        )
        return int(sizes[0]) if sizes else 0

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until every server is alive (after a restart and reconnection); returns whether
        they all are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not all(s.state == "alive" for s in self.servers):
                if self._closed or all(
                    s.state == "stopped" or (s.state == "lost" and not self._can_restart(s))
                    for s in self.servers
                    if s.state != "alive"
                ):
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the monitor, closes the connections, stops the servers and their actors,
        removes the placement group and, when :func:`launch` started Ray, stops Ray.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout)
        ray = self._ray
        with self._lock:
            connections = [s.connection for s in self.servers if s.connection is not None]
            for s in self.servers:
                s.connection = None
                s.devices = []
        # The user may still hold some of the devices (a model, a scheduler): closing the
        # connections makes every later call on them fail at once.
        for connection in connections:
            _close(connection)
        stops = [a.stop.remote() for a in self._actors]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        # wait for the actors to be gone, so their bundles are free when we return
        deadline = time.monotonic() + timeout
        for actor in self._actors:
            left = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(Exception):
                ray.get(actor.ping.remote(), timeout=left)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.placement_group)
        with self._lock:
            for s in self.servers:
                s.state = "stopped"
            self.generation += 1
        if self.owns_ray:
            stop_ray(ray)
        logger.info("cluster shut down")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        with self._lock:
            states = [s.state for s in self.servers]
            nodes = len({s.node_id for s in self.servers if s.node_id})
            n_devices = sum(len(s.devices) for s in self.servers if s.state == "alive")
            endpoints = [s.endpoint for s in self.servers]
        summary = ", ".join(f"{states.count(k)} {k}" for k in dict.fromkeys(states))
        return (
            f"Cluster({len(states)} servers on {nodes} node(s): {summary}; "
            f"strategy={self.strategy!r}, cpus_per_server={self.cpus_per_server}, "
            f"devices={n_devices}, endpoints={endpoints}, generation={self.generation})"
        )

    # ----- internals -----

    def _can_restart(self, s: ServerState) -> bool:
        return self.max_restarts < 0 or s.restarts < self.max_restarts

    def _connect(self, index: int, timeout: float) -> None:
        """Asks actor ``index`` where its server is and connects to it."""
        info = self._ray.get(self._actors[index].info.remote(), timeout=timeout)
        connection = open_connection(info["endpoint"], token=self.__token)
        devices = connection.devices
        with self._lock:
            s = self.servers[index]
            if s.incarnation and s.incarnation != info["incarnation"]:
                s.restarts += 1
            s.endpoint = info["endpoint"]
            s.node_id = info["node_id"]
            s.node_ip = info["node_ip"]
            s.pid = info["pid"]
            s.actor_pid = info["actor_pid"]
            s.incarnation = info["incarnation"]
            s.connection = connection
            s.devices = devices
            s.state = "alive"
            s.lost_reason = None
            self.generation += 1
            self._lock.notify_all()
        logger.info(
            "server %d at %s on node %s: %d device(s)",
            index,
            info["endpoint"],
            info["node_ip"],
            len(devices),
        )

    def _mark_lost(self, index: int, reason: str) -> None:
        with self._lock:
            s = self.servers[index]
            if s.state != "alive":
                return
            s.state = "lost"
            s.lost_reason = reason
            s.lost_at = time.monotonic()
            connection = s.connection
            s.connection = None
            s.devices = []
            self.generation += 1
            self._lock.notify_all()
        logger.warning("server %d (%s) lost: %s", index, s.endpoint, reason)
        if connection is not None:
            # its devices' calls, even one blocked on the server, raise DeviceLostError now
            _close(connection)
        if self._on_lost is not None:
            try:
                self._on_lost(s)
            except Exception:
                logger.exception("the on_lost callback failed")

    def _start_monitor(self) -> None:
        self._monitor = threading.Thread(
            target=self._watch, name="ferrograph-cluster-monitor", daemon=True
        )
        self._monitor.start()

    def _watch(self) -> None:
        ray = self._ray
        pending: dict[Any, int] = {}
        while not self._stop.is_set():
            busy = set(pending.values())
            with self._lock:
                watched = [
                    i
                    for i, s in enumerate(self.servers)
                    if s.state == "alive" or (s.state == "lost" and self._can_restart(s))
                ]
            for i in watched:
                if i not in busy:
                    pending[self._actors[i].ping.remote()] = i
            if not pending:
                self._stop.wait(self.monitor_interval)
                continue
            try:
                done, _ = ray.wait(
                    list(pending), num_returns=len(pending), timeout=self.monitor_interval
                )
            except Exception:  # Ray shutting down
                if self._stop.is_set():
                    return
                logger.debug("monitor wait failed", exc_info=True)
                time.sleep(self.monitor_interval)
                continue
            for ref in done:
                i = pending.pop(ref)
                try:
                    incarnation = ray.get(ref)
                except Exception as error:
                    if self._stop.is_set():
                        return
                    self._mark_lost(i, f"{type(error).__name__}: {first_line(error)}")
                    continue
                with self._lock:
                    s = self.servers[i]
                    restarted = s.incarnation != incarnation
                    needs_connect = s.state == "lost" or (s.state == "alive" and restarted)
                if needs_connect and not self._stop.is_set():
                    if s.state == "alive":
                        self._mark_lost(i, "the server restarted")
                    try:
                        self._connect(i, self.ready_timeout)
                    except Exception as error:
                        logger.warning("reconnecting to server %d failed: %s", i, error)
            if done:
                time.sleep(self.monitor_interval)
