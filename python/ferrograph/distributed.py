"""Device servers placed and supervised by Ray: ``fg.distributed.launch(n)`` in one call.

>>> import ferrograph as fg
>>> with fg.distributed.launch(2, strategy="SPREAD") as cluster:   # doctest: +SKIP
...     sched = fg.Scheduler([*cluster.backends(), fg.init_backend("CPU")])
...     model = MiniLM(devices=[ds[0] for ds in cluster.devices_per_server])

Ray does the placement, the lifecycle and the failure detection; tensor bytes travel on
ferrograph's own TCP connections (:mod:`ferrograph.remote`), not through Ray's object store
(the issue measured, with Ray 2.60, a 6 MB hop between two actors at ~26 ms through the object
store and ~4 ms over a direct socket). :meth:`Cluster.preload_weights` is the one exception, an
opt-in: weights through the object store into the servers' weight caches.

What :func:`launch` does
------------------------
* It connects to a running Ray cluster (``address="auto"`` or ``"host:port"``), uses the one this
  process is already connected to, or (``address=None`` and none) starts a local one on loopback
  only: ``include_dashboard=False``, ``RAY_USAGE_STATS_ENABLED=0`` and the node's address
  127.0.0.1, so nothing listens beyond loopback and nothing reaches out to the internet.
* It reserves a placement group with one bundle of ``cpus_per_server`` CPUs per server, under
  ``strategy`` (``"SPREAD"``, ``"STRICT_SPREAD"``: one server per node, ``"PACK"``,
  ``"STRICT_PACK"``), and fails with :class:`LaunchError` (never waits forever) when Ray cannot
  place it within ``ready_timeout`` seconds.
* One actor per bundle starts ``ferrograph serve`` on an ephemeral port of its node's address
  with a token made for this launch (:func:`secrets.token_hex`): it is handed to the actors and
  the server through its environment, never logged, printed or put in a ``repr``. The server
  process is tied to its actor (on Linux it is killed when the actor dies, and the actor exits
  when its server does), so Ray's view of the actor is the server's fate.
* The devices of every server are connected with :func:`ferrograph.remote.connect`.

Supervision
-----------
A monitor thread pings every actor (``monitor_interval``, 0.2 s by default). Ray reports a dead
actor within milliseconds (``ActorDiedError``); the monitor then closes that server's client
connection, so a compute running on its devices fails at once with
:class:`ferrograph.DeviceLostError` instead of waiting for a TCP deadline. With
``max_restarts=k`` Ray restarts a dead server up to ``k`` times; the monitor reconnects to the
new server and bumps :attr:`Cluster.generation`, after which :attr:`Cluster.devices` holds the
new devices (build a new scheduler from them). :meth:`Cluster.wait_ready` waits for that.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import BackendError, Error, InvalidArgumentError

__all__ = [
    "STRATEGIES",
    "Cluster",
    "LaunchError",
    "RayNotInstalledError",
    "ServerState",
    "keep_ray_on_loopback",
    "launch",
    "place_layers",
]

logger = logging.getLogger("ferrograph.distributed")

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
"""Placement strategies Ray accepts for the servers' placement group."""

CACHED_WRITE_MIN = 1 << 20
"""Tensor writes of at least this many bytes go through a server's weight cache (the remote
client's threshold)."""

_INSTALL_HINT = 'pip install "ferrograph[distributed]"   (or: pip install "ray>=2.9")'

# Environment of a Ray started here: no usage reports, no control service on the outward
# interface (measured: without these Ray bound its control service beyond loopback).
_LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class RayNotInstalledError(Error, ImportError):
    """``ray`` is not importable: install the ``distributed`` extra."""


class LaunchError(Error, RuntimeError):
    """Servers could not be placed, started or connected (the message says which and why)."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalledError(
            f"ferrograph.distributed needs Ray ({error}); install it with: {_INSTALL_HINT}"
        ) from error
    return ray


# ----- the actor side -----------------------------------------------------------------------


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a function to run in the server's child process before exec that asks the
    kernel to kill it when the thread that started it (the actor's keeper thread, alive as long
    as the actor) goes away. Resolved here, in the parent, so the child only makes one call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def in_child() -> None:  # pragma: no cover - runs between fork and exec
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    return in_child


class ServerHost:
    """Runs one ``ferrograph serve`` process inside a Ray actor (created by :func:`launch`).

    A keeper thread starts the server, reads the ``host:port`` it prints first, then drains
    its output into the actor's log; when the server exits without :meth:`stop` having been
    called, the keeper ends the actor's process, so Ray sees the actor die (and restarts it
    when ``max_restarts`` allows).
    """

    def __init__(
        self, token: str, host: str | None, threads: int, command: Sequence[str], timeout: float
    ) -> None:
        ray: Any = _import_ray()

        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()
        self.incarnation = secrets.token_hex(8)
        self.__token = token  # for warm_cache's own connection; never logged
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._failure: str | None = None
        self.endpoint = ""
        self.pid = 0
        argv = [*command, "--host", host or self.node_ip, "--port", "0", "--threads", str(threads)]
        env = dict(os.environ, FERROGRAPH_TOKEN=token)
        self._keeper = threading.Thread(
            target=self._keep, args=(argv, env), name="ferrograph-server-keeper", daemon=True
        )
        self._keeper.start()
        if not self._ready.wait(timeout):
            self._failure = self._failure or f"no address printed within {timeout:.0f} s"
        if not self.endpoint:
            self.stop()
            tail = "\n".join(self._stderr_tail)
            raise RuntimeError(
                f"ferrograph serve ({shlex.join(argv)}) did not start on node {self.node_ip}: "
                f"{self._failure}" + (f"\nits stderr:\n{tail}" if tail else "")
            )

    def _keep(self, argv: list[str], env: dict[str, str]) -> None:
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_parent_death_signal(),  # ties the server to this actor
            )
        except OSError as error:
            self._failure = f"cannot run it: {error}"
            self._ready.set()
            return
        self._proc = proc
        self.pid = proc.pid
        threading.Thread(target=self._drain_stderr, args=(proc,), daemon=True).start()
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        bound, _, port = first.rpartition(":")
        if bound and port.isdigit():
            # a server bound to every interface is reached at its node's address
            wildcard = bound in ("0.0.0.0", "[::]", "::")
            self.endpoint = f"{self.node_ip}:{port}" if wildcard else first
        else:
            self._failure = f"it printed {first!r} instead of host:port"
        self._ready.set()
        for line in proc.stdout:
            print(f"[ferrograph serve] {line.rstrip()}", file=sys.stderr)
        code = proc.wait()
        if not self._stopping.is_set() and self.endpoint:
            print(
                f"[ferrograph] server {self.endpoint} exited with status {code}: ending its actor",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def _drain_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self._stderr_tail.append(line.rstrip())
            print(f"[ferrograph serve] {line.rstrip()}", file=sys.stderr)

    def info(self) -> dict[str, Any]:
        """Where the server runs: endpoint, pid, the actor's pid, node id and address,
        incarnation."""
        return {
            "endpoint": self.endpoint,
            "pid": self.pid,
            "actor_pid": os.getpid(),
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "incarnation": self.incarnation,
        }

    def warm_cache(self, refs: list[Any]) -> int:
        """Writes every blob of the object ``refs[0]`` (a list of byte arrays, read from the
        object store: zero-copy on this node) into a buffer of this node's server over
        loopback, so the server's weight cache holds them; returns the bytes written. The
        buffer goes with this connection; the cache entries stay for other clients."""
        import ferrograph as fg

        ray: Any = _import_ray()
        blobs: list[Any] = ray.get(refs[0])
        device = fg.remote.connect(self.endpoint, token=self.__token)[0]
        for blob in blobs:  # one at a time: the session never holds more than one
            ctx = fg.Context()
            tensor = ctx.new_tensor(fg.int8, (len(blob),))
            buffer = fg.alloc_ctx_tensors(ctx, device.buffer_type)
            fg.tensor_set(tensor, blob)
            del buffer, tensor, ctx
        return sum(len(b) for b in blobs)

    def ping(self) -> str:
        """The incarnation (a new one after each restart); raises if the server is gone."""
        proc = getattr(self, "_proc", None)
        if proc is None or proc.poll() is not None:
            raise RuntimeError("the server process is not running")
        return self.incarnation

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stops the server (SIGTERM, then SIGKILL after ``timeout``); returns its status."""
        self._stopping.set()
        proc = getattr(self, "_proc", None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        code: int | None = proc.returncode
        return code


# ----- the driver side ----------------------------------------------------------------------


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
    connection: Any = None
    """What :func:`ferrograph.remote.connect` returned for it."""
    devices: list[Any] = field(default_factory=list)
    lost_at: float | None = None
    """``time.monotonic()`` when the monitor saw the actor die."""


def _devices_of(connection: Any) -> list[Any]:
    """The devices of what :func:`ferrograph.remote.connect` returned (a list of devices, or an
    object with a ``devices`` attribute or method)."""
    if isinstance(connection, (list, tuple)):
        return list(connection)
    devices = getattr(connection, "devices", None)
    if callable(devices):
        devices = devices()
    if devices is None:
        raise LaunchError(f"cannot find the devices of {connection!r}")
    return list(devices)


def _socket_inodes_to(addresses: set[tuple[str, int]]) -> set[int]:
    """Inodes of this machine's TCP sockets whose peer is one of ``addresses`` (IP, port),
    from ``/proc/net/tcp`` and ``/proc/net/tcp6``."""
    import ipaddress

    wanted = set()
    for host, port in addresses:
        ip = ipaddress.ip_address(host)
        wanted.add((ip, port))
        if isinstance(ip, ipaddress.IPv4Address):  # the same peer seen by an IPv6 socket
            wanted.add((ipaddress.IPv6Address(f"::ffff:{ip}"), port))
    inodes = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10:
                continue
            peer_hex, port_hex = fields[2].split(":")
            if len(peer_hex) != width:
                continue
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(bytes.fromhex(peer_hex[i : i + 8])[::-1] for i in range(0, width, 8))
            peer = ipaddress.ip_address(raw)
            if (peer, int(port_hex, 16)) in wanted:
                inodes.add(int(fields[9]))
    return inodes


def sever_connections(endpoint: str) -> int:
    """Shuts down every TCP connection of this process to ``endpoint`` (``host:port``), so
    the remote client's waits on it end at once (as when the server closes them). Returns how
    many were shut down (0 where ``/proc`` is not available: the client then notices at its
    heartbeat deadline).

    This is how the monitor marks a server's devices lost: :func:`ferrograph.remote.connect`
    hands out devices without a handle on their connection, and shutting the socket down
    (not closing its descriptor, which the client owns) is the smallest change that wakes it.
    """
    import socket

    host, _, port_text = endpoint.rpartition(":")
    try:
        port = int(port_text)
        infos = socket.getaddrinfo(host.strip("[]"), port, proto=socket.IPPROTO_TCP)
    except (ValueError, OSError):
        return 0
    addresses = {(str(info[4][0]), port) for info in infos}
    inodes = _socket_inodes_to(addresses)
    if not inodes:
        return 0
    severed = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for fd_text in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd_text}")
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
            continue
        try:
            # a duplicate of the descriptor: shutdown acts on the shared socket, close only on
            # the duplicate, so the client's descriptor stays valid and its reads see the end
            dup = socket.socket(fileno=os.dup(int(fd_text)))
        except OSError:
            continue
        with dup:
            try:
                dup.shutdown(socket.SHUT_RDWR)
                severed += 1
            except OSError:
                pass
    return severed


def _close_connection(endpoint: str) -> int:
    """Marks a server's devices lost by shutting its client connections down; returns how
    many were."""
    try:
        return sever_connections(endpoint) if endpoint else 0
    except Exception:  # never let the monitor die on it
        logger.debug("severing %s failed", endpoint, exc_info=True)
        return 0


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
            raise BackendError(f"preloading weights failed: {_actor_failure(error)}") from error
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
            endpoints = [s.endpoint for s in self.servers if s.devices]
            for s in self.servers:
                s.connection = None
                s.devices = []
        # Without other references the devices' connections are closed by now; the user may
        # still hold some (a model, a scheduler): shut those down so they fail fast.
        for endpoint in endpoints:
            _close_connection(endpoint)
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
            ray.shutdown()
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
        remote: Any = importlib.import_module("ferrograph.remote")
        connection = remote.connect(info["endpoint"], token=self.__token)
        devices = _devices_of(connection)
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
            connection, devices = s.connection, s.devices
            s.connection = None
            s.devices = []
            self.generation += 1
            self._lock.notify_all()
        logger.warning("server %d (%s) lost: %s", index, s.endpoint, reason)
        del connection, devices
        if not _close_connection(s.endpoint):
            logger.info(
                "no connection to server %d found to shut down; computes on it end at the "
                "client's heartbeat deadline",
                index,
            )
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
                    self._mark_lost(i, f"{type(error).__name__}: {_first_line(error)}")
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(error: BaseException) -> str:
    text = _ANSI.sub("", str(error)).strip()
    return text.splitlines()[0] if text else ""


def _actor_failure(error: BaseException) -> str:
    """What made an actor fail: the message our actor raised when Ray's error carries it (an
    actor's creation error is wrapped in Ray's own text and traceback), else the first line."""
    text = _ANSI.sub("", str(error))
    marker = "RuntimeError: ferrograph serve"
    at = text.rfind(marker)
    if at >= 0:
        return text[at + len("RuntimeError: ") :].strip()
    # a task's error: Ray's header line, the remote traceback, then the error itself
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("ray::"):
        return lines[-1]
    return _first_line(error)


def _check_launch_args(
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


def keep_ray_on_loopback() -> None:
    """Makes the next Ray started in this process (and its child processes) use loopback only
    and send no usage statistics.

    Ray on Linux resolves a node address of 127.0.0.1 to the machine's outward address (and
    binds its services there, or on every interface) unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    is ``0``, a setting it reads once, when ``ray`` is first imported: so this sets the
    environment for the processes Ray starts and, when ``ray`` is already imported, the value
    it read.
    """
    os.environ.update(_LOCAL_RAY_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010 (a module of Ray's)


def _start_ray(ray: Any, address: str | None, n_cpus: float) -> bool:
    """Connects to Ray; returns whether this call started it (and so must stop it)."""
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return False
    keep_ray_on_loopback()
    ray.init(
        address="local",  # a new one, never a cluster someone else started on this machine
        num_cpus=max(os.cpu_count() or 1, int(n_cpus + 0.999)),
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    addresses = {n.get("NodeManagerAddress") for n in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        ray.shutdown()
        raise LaunchError(
            f"the local Ray started on {sorted(map(str, addresses))} instead of 127.0.0.1 only; "
            f"stopped it (set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray)"
        )
    logger.info("started a local Ray on 127.0.0.1 (no dashboard, no usage stats)")
    return True


SERVER_COMMAND_ENV = "FERROGRAPH_SERVER_COMMAND"
"""Environment variable naming the server command line (shell words), e.g. an installed
``ferrograph serve`` binary; read by :func:`default_server_command`."""


def default_server_command() -> list[str]:
    """The server command before its options: ``$FERROGRAPH_SERVER_COMMAND`` when set, else
    ``python -m ferrograph serve`` with this interpreter (Ray's workers run the same one)."""
    configured = os.environ.get(SERVER_COMMAND_ENV, "").strip()
    if configured:
        return shlex.split(configured)
    return [sys.executable, "-m", "ferrograph", "serve"]


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
    _check_launch_args(
        n_servers, cpus_per_server, strategy, max_restarts, ready_timeout, monitor_interval
    )
    if threads is None:
        threads = max(1, int(cpus_per_server))
    if address is None and "ray" not in sys.modules:
        keep_ray_on_loopback()  # before Ray reads its settings at import
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    start = time.perf_counter()
    owns_ray = _start_ray(ray, address, n_servers * cpus_per_server)
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
                raise LaunchError(f"server {i}: {_actor_failure(error)}") from error
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
                ray.shutdown()
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


# ----- layers over devices ----------------------------------------------------------------


def copy_weights(
    weights: dict[str, Any], moved: dict[int, list[str]], backends: Sequence[Any]
) -> list[tuple[Any, Any]]:
    """Copies the named tensors of ``weights`` into a weights buffer on ``backends[home]``
    for each ``home, names`` of ``moved``, and points ``weights`` at the copies. Returns the
    (context, buffer) pairs that keep the copies alive.

    Raises
    ------
    ferrograph.AllocationError
        If a backend gives no buffer.
    """
    import ferrograph as fg

    placed = []
    for home, names in sorted(moved.items()):
        ctx = fg.Context()
        copies = {}
        for name in names:
            old = weights[name]
            copies[name] = ctx.new_tensor(old.dtype, old.shape, name=name)
        buffer = fg.alloc_ctx_tensors(ctx, backends[home])
        if buffer is None:
            raise fg.AllocationError(f"no weights buffer on {backends[home].name}")
        buffer.usage = fg.BufferUsage.WEIGHTS
        for name, copy in copies.items():
            fg.tensor_copy(weights[name], copy)
        weights.update(copies)
        placed.append((ctx, buffer))
    return placed


def place_layers(model: Any, devices: Sequence[Any]) -> list[int]:
    """Spreads a :class:`ferrograph.models.SentenceEncoder`'s encoder layers over ``devices``
    (devices, e.g. :attr:`Cluster.devices`, or backends opened on them).

    With ``k`` devices, consecutive runs of about ``n_layers / k`` layers go to one device
    each: their weights are copied once into a weights buffer on that device, so the
    scheduler runs those layers there. Embeddings, pooling and normalisation stay on the
    model's own backend; the scheduler copies activations between the devices. Sets
    ``model.backends`` (the local backend first, then one per device), ``model.layer_homes``
    (per layer, an index into ``model.backends``) and a new ``model.scheduler``; returns
    ``model.layer_homes``.

    Raises
    ------
    ferrograph.InvalidArgumentError
        If ``devices`` is empty.
    ferrograph.DeviceLostError
        If a remote device's server is gone.
    """
    import ferrograph as fg

    if not devices:
        raise InvalidArgumentError("place_layers needs at least one device")
    backends = [model.backend] + [
        d if isinstance(d, fg.Backend) else d.init_backend() for d in devices
    ]
    n_layers, k = model.config.num_hidden_layers, len(devices)
    homes = [1 + i * k // n_layers for i in range(n_layers)]
    moved: dict[int, list[str]] = {}
    for name in model.weights:
        if name.startswith("encoder.layer."):
            moved.setdefault(homes[int(name.split(".")[2])], []).append(name)
    placed = copy_weights(model.weights, moved, backends)
    # keep the devices' weights alive with the model; rebuild the plan from scratch
    model.placed_weights = placed
    model.backends = backends
    model.layer_homes = homes
    model.set_scheduler(fg.Scheduler([*backends[1:], *model.scheduler.backends]))
    logger.info(
        "layers of %s over %s: %s",
        type(model).__name__,
        [b.name for b in backends[1:]],
        homes,
    )
    return homes
