"""Remote devices: computing on other machines' CPUs through ferrograph device servers.

A server (``python -m ferrograph serve`` or the ``ferrograph`` binary's ``ferrograph serve``)
exposes its machine's devices over TCP; :func:`connect` returns them as ordinary
:class:`ferrograph.Device` objects, usable in a :class:`ferrograph.Scheduler` beside the local
CPU. Both sides share a token (``token=`` or the ``FERROGRAPH_TOKEN`` environment variable):
it keys a Noise handshake (mutual authentication, then encrypted traffic) and never travels. A
server that dies or hangs makes calls on its devices raise :class:`ferrograph.DeviceLostError`
within a few seconds.

>>> import ferrograph as fg
>>> with fg.remote.spawn_server(token="s3cret") as server:   # doctest: +SKIP
...     devices = fg.remote.connect(server.address, token="s3cret")
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from types import TracebackType
from typing import IO

from ._core import Device, RemoteServer, remote_connect

__all__ = ["RemoteServer", "ServerProcess", "connect", "spawn_server"]

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
    pushes to for direct server-to-server copies. Raises :class:`RuntimeError` if the server
    does not start within ``timeout`` seconds.
    """
    args = [sys.executable, "-m", "ferrograph", "serve", "--host", host, "--port", str(port)]
    if n_threads is not None:
        args += ["--threads", str(n_threads)]
    if peers:
        args += ["--peers", ",".join(peers)]
    env = dict(os.environ, FERROGRAPH_TOKEN=token)
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    first_line: list[str] = []
    reader = threading.Thread(
        target=lambda: first_line.append(process.stdout.readline() if process.stdout else ""),
        daemon=True,
    )
    reader.start()
    reader.join(timeout)
    address = first_line[0].strip() if first_line else ""
    if not address:
        process.kill()
        _, err = process.communicate()
        raise RuntimeError(f"the device server did not start: {err.strip()}")
    logger.info("device server %s started (pid %d)", address, process.pid)

    def drain(stream: IO[str] | None) -> None:
        # Keeps the child from blocking on a full pipe; its messages go to our log.
        for line in stream or ():
            logger.debug("server %s: %s", address, line.rstrip())

    for stream in (process.stdout, process.stderr):
        threading.Thread(target=drain, args=(stream,), daemon=True).start()
    return ServerProcess(process, address)
