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

The package, by idea: ``_ray`` (importing, starting and joining Ray; the errors),
``_host`` (the actor that runs a server: :class:`ServerHost`), ``_cluster`` (:class:`Cluster`
and :class:`ServerState`: connections, monitor, shutdown), ``_launch`` (:func:`launch`) and
``_placement`` (:func:`place_layers`). The server process itself is started by
:mod:`ferrograph._server_process`, which :func:`ferrograph.remote.spawn_server` uses too.
"""

from __future__ import annotations

# The names outside __all__ are re-exported too (``X as X``), importable from here as before
# the module became a package.
from .._server_process import SERVER_COMMAND_ENV as SERVER_COMMAND_ENV
from .._server_process import default_server_command as default_server_command
from ._cluster import CACHED_WRITE_MIN as CACHED_WRITE_MIN
from ._cluster import Cluster, ServerState
from ._host import ServerHost as ServerHost
from ._launch import STRATEGIES, launch
from ._placement import copy_weights as copy_weights
from ._placement import place_layers
from ._ray import LaunchError, RayNotInstalledError, keep_ray_on_loopback, ray_home

__all__ = [
    "STRATEGIES",
    "Cluster",
    "LaunchError",
    "RayNotInstalledError",
    "ServerState",
    "keep_ray_on_loopback",
    "launch",
    "place_layers",
    "ray_home",
]
