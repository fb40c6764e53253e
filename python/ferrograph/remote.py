"""Remote devices: computing on other machines' CPUs through ferrograph device servers.

A server (``python -m ferrograph serve`` or the ``ferrograph`` binary's ``ferrograph serve``)
exposes its machine's devices over TCP; :func:`connect` returns them as ordinary
:class:`ferrograph.Device` objects, usable in a :class:`ferrograph.Scheduler` beside the local
CPU. Both sides share a token (``token=`` or the ``FERROGRAPH_TOKEN`` environment variable):
it keys a Noise handshake (mutual authentication, then encrypted traffic) and never travels. A
server that dies or hangs makes calls on its devices raise :class:`ferrograph.DeviceLostError`
within a few seconds.

:func:`connect` returns the devices alone (the connection closes when the last of them, their
buffers and backends is gone); :func:`open_connection` returns a :class:`RemoteConnection`
handle with the same devices and a :meth:`RemoteConnection.close` that ends the connection at
once, whoever still holds its devices.

>>> import ferrograph as fg
>>> with fg.remote.spawn_server(token="s3cret") as server:   # doctest: +SKIP
...     devices = fg.remote.connect(server.address, token="s3cret")
...     with fg.remote.open_connection(server.address, token="s3cret") as conn:
...         backend = conn.devices[0].init_backend()
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import TracebackType

from ._core import Device, RemoteConnection, RemoteServer, remote_connect, remote_open
from ._server_process import start_server

__all__ = [
    "RemoteConnection",
    "RemoteServer",
    "ServerProcess",
    "connect",
    "open_connection",
    "spawn_server",
]

logger = logging.getLogger("ferrograph.remote")


def connect(
    endpoint: str,
    token: str | None = None,
    *,
    connect_timeout: float = 5.0,
    heartbeat: float = 0.5,
    dead_after: float = 3.0,
    request_timeout: float = 600.0,
    direct_copies: bool = True,
) -> list[Device]:
    """Connects to the device server at ``endpoint`` (``"host:port"``); returns its devices.

    ``token`` defaults to the ``FERROGRAPH_TOKEN`` environment variable. Heartbeats go out
    every ``heartbeat`` seconds; a server silent for ``dead_after`` seconds counts as lost.
    With ``direct_copies``, a tensor needed on this server that lives on another is pushed by
    that server directly (both must share the token), else it goes through this process.
    Raises :class:`ferrograph.InvalidArgumentError` for a wrong token or endpoint and
    :class:`ferrograph.BackendError` when the server cannot be reached.
    """
    return remote_connect(
        endpoint,
        token,
        connect_timeout=connect_timeout,
        heartbeat=heartbeat,
        dead_after=dead_after,
        request_timeout=request_timeout,
        direct_copies=direct_copies,
    )


def open_connection(
    endpoint: str,
    token: str | None = None,
    *,
    connect_timeout: float = 5.0,
    heartbeat: float = 0.5,
    dead_after: float = 3.0,
    request_timeout: float = 600.0,
    direct_copies: bool = True,
) -> RemoteConnection:
    """Connects like :func:`connect` but returns the connection: a :class:`RemoteConnection`
    whose ``devices`` are the server's devices and whose ``close()`` ends the connection.

    After ``close()`` (idempotent; also on leaving a ``with`` block) every call on its devices,
    their buffers and backends raises :class:`ferrograph.DeviceLostError` at once, including one
    blocked waiting for the server, and so does reading ``devices``; the server frees the
    connection's buffers and goes on serving its other clients. Raises like :func:`connect`.
    """
    return remote_open(
        endpoint,
        token,
        connect_timeout=connect_timeout,
        heartbeat=heartbeat,
        dead_after=dead_after,
        request_timeout=request_timeout,
        direct_copies=direct_copies,
    )


class ServerProcess:
    """A device server in a child process (see :func:`spawn_server`); a context manager that
    stops it on exit."""

    def __init__(self, process: subprocess.Popen[str], address: str) -> None:
        self.process = process
        self.address = address

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        """Terminates the server (killing it if it does not exit within ``timeout``)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    def kill(self) -> None:
        """Kills the server at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process.poll() is None else f"exited {self.process.returncode}"
        return f"ServerProcess(address='{self.address}', pid={self.pid}, {state})"


def spawn_server(
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    n_threads: int | None = None,
    peers: list[str] | None = None,
    timeout: float = 30.0,
) -> ServerProcess:
    """Starts ``python -m ferrograph serve`` in a child process and waits for its address.

    The token is handed over in the child's environment (not on its command line, where other
    users could read it). ``peers`` (``"ip:port"`` addresses) are the only servers the new one
    pushes to for direct server-to-server copies. The server's later output goes to this
    module's logger at debug level.

    Raises
    ------
    ferrograph.InvalidArgumentError
        For a ``port`` outside 0-65535, an ``n_threads`` below 1, a ``timeout`` that is not a
        positive number or a malformed ``peers`` entry.
    ferrograph.BackendError
        If the server does not start: it cannot be run, it exits first (the port is taken,
        the host cannot be bound, ...; the message quotes its stderr) or it prints no address
        within ``timeout`` seconds. ``BackendError`` is a ``RuntimeError``, what this function
        raised before.
    """
    pid = [0]

    def echo(line: str) -> None:
        logger.debug("server pid %d: %s", pid[0], line)

    started = start_server(
        token,
        command=[sys.executable, "-m", "ferrograph", "serve"],
        host=host,
        port=port,
        n_threads=n_threads,
        peers=peers,
        timeout=timeout,
        echo=echo,
    )
    pid[0] = started.process.pid
    logger.info("device server %s started (pid %d)", started.address, started.process.pid)
    return ServerProcess(started.process, started.address)
