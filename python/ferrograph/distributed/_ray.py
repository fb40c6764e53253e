"""Ray plumbing of :mod:`ferrograph.distributed`: importing Ray, starting or joining it on
loopback, the two errors of a launch, and reading the failures Ray reports."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from ..errors import Error

logger = logging.getLogger("ferrograph.distributed")

_INSTALL_HINT = 'pip install "ferrograph[distributed]"   (or: pip install "ray>=2.9")'

# Environment of a Ray started here: no usage reports, no control service on the outward
# interface (measured: without these Ray bound its control service beyond loopback), and the
# address Ray reports to — even that usage statistics are off, from clusters not started by
# `ray.init` (traced: a DNS lookup of usage-stats.ray.io) — a closed loopback port.
_LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:1/",
}


class RayNotInstalledError(Error, ImportError):
    """``ray`` is not importable: install the ``distributed`` extra."""


class LaunchError(Error, RuntimeError):
    """Servers could not be placed, started or connected (the message says which and why)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalledError(
            f"ferrograph.distributed needs Ray ({error}); install it with: {_INSTALL_HINT}"
        ) from error
    return ray


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


# The home directory of the processes of the Ray `start_ray` started (see `ray_home`).
_ray_home: str | None = None


@contextlib.contextmanager
def ray_home() -> Iterator[str]:
    """While open, processes started from this one (Ray's, by ``ray.init`` or
    ``ray.cluster_utils.Cluster``) get a fresh home directory holding an empty
    ``ray_bootstrap_config.yaml``; yields its path. On exit this process's ``HOME`` is restored;
    the started processes keep theirs, so remove the directory after stopping that Ray.

    Why: even with ``include_dashboard=False`` Ray starts a dashboard process whose usage module,
    usage statistics off or not, reads that file from the home directory and, when it is
    missing, asks the cloud metadata services (169.254.169.254, metadata.google.internal) which
    cloud it runs on — a connection beyond loopback. With the file present it reads the file.
    Use it with :func:`keep_ray_on_loopback` when starting Ray yourself."""
    home = tempfile.mkdtemp(prefix="ferrograph-ray-")
    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w", encoding="utf-8") as f:
        f.write("{}\n")
    saved = os.environ.get("HOME")
    os.environ["HOME"] = home
    try:
        yield home
    finally:
        if saved is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = saved


def start_loopback_cluster(n_nodes: int, cpus_per_node: int) -> tuple[Any, list[Any], str]:
    """Starts a Ray cluster of ``n_nodes`` worker nodes of ``cpus_per_node`` CPUs (and a head
    node without CPUs) on this machine, on loopback and in the quiet home (:func:`ray_home`),
    and connects this process to it: several nodes for the tests and benchmarks of placement.
    Returns the ``ray.cluster_utils.Cluster``, its worker nodes and the home directory (remove
    it after ``ray.shutdown()`` and ``cluster.shutdown()``)."""
    keep_ray_on_loopback()  # before Ray reads its settings at import
    ray = import_ray()
    from ray.cluster_utils import Cluster

    with ray_home() as home:  # no cloud metadata requests from Ray's processes
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        workers = [
            cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
            for _ in range(n_nodes)
        ]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster, workers, home


def start_ray(ray: Any, address: str | None, n_cpus: float) -> bool:
    """Connects to Ray; returns whether this call started it (and so must stop it with
    :func:`stop_ray`)."""
    global _ray_home
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return False
    keep_ray_on_loopback()
    with ray_home() as home:
        try:
            ray.init(
                address="local",  # a new one, never a cluster someone else started here
                num_cpus=max(os.cpu_count() or 1, int(n_cpus + 0.999)),
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",
            )
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
    _ray_home = home
    addresses = {n.get("NodeManagerAddress") for n in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        stop_ray(ray)
        raise LaunchError(
            f"the local Ray started on {sorted(map(str, addresses))} instead of 127.0.0.1 only; "
            f"stopped it (set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray)"
        )
    logger.info("started a local Ray on 127.0.0.1 (no dashboard, no usage stats)")
    return True


def stop_ray(ray: Any) -> None:
    """Shuts down the Ray :func:`start_ray` started and removes its processes' home."""
    global _ray_home
    ray.shutdown()
    if _ray_home is not None:
        shutil.rmtree(_ray_home, ignore_errors=True)
        _ray_home = None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(error: BaseException) -> str:
    text = _ANSI.sub("", str(error)).strip()
    return text.splitlines()[0] if text else ""


def actor_failure(error: BaseException) -> str:
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
    return first_line(error)
