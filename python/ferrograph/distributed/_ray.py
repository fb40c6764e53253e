"""Ray plumbing of :mod:`ferrograph.distributed`: importing Ray, starting or joining it on
loopback, the two errors of a launch, and reading the failures Ray reports."""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

from ..errors import Error

logger = logging.getLogger("ferrograph.distributed")

_INSTALL_HINT = 'pip install "ferrograph[distributed]"   (or: pip install "ray>=2.9")'

# Environment of a Ray started here: no usage reports, no control service on the outward
# interface (measured: without these Ray bound its control service beyond loopback).
_LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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


def start_ray(ray: Any, address: str | None, n_cpus: float) -> bool:
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
