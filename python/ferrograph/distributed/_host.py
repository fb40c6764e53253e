"""The actor side of :mod:`ferrograph.distributed`: :class:`ServerHost`, the Ray actor that runs
one ``ferrograph serve`` process (started by :func:`ferrograph._server_process.start_server`)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .._server_process import start_server
from ..errors import Error
from ._ray import import_ray


class ServerHost:
    """Runs one ``ferrograph serve`` process inside a Ray actor (created by
    :func:`~ferrograph.distributed.launch`).

    A keeper thread starts the server (:func:`ferrograph._server_process.start_server`: it
    reads the ``host:port`` the server prints first, then drains its output into the actor's
    log); when the server exits without :meth:`stop` having been called, the keeper ends the
    actor's process, so Ray sees the actor die (and restarts it when ``max_restarts`` allows).
    """

    def __init__(
        self, token: str, host: str | None, threads: int, command: Sequence[str], timeout: float
    ) -> None:
        ray: Any = import_ray()

        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()
        self.incarnation = secrets.token_hex(8)
        self.__token = token  # for warm_cache's own connection; never logged
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._failure: str | None = None
        self.endpoint = ""
        self.pid = 0
        self._keeper = threading.Thread(
            target=self._keep,
            args=(token, host or self.node_ip, threads, list(command), timeout),
            name="ferrograph-server-keeper",
            daemon=True,
        )
        self._keeper.start()
        # start_server gives up after `timeout`; the margin covers killing the process
        if not self._ready.wait(timeout + 10):
            self._failure = self._failure or f"no address printed within {timeout:.0f} s"
        if not self.endpoint:
            self.stop()
            raise RuntimeError(f"ferrograph serve on node {self.node_ip}: {self._failure}")

    def _keep(
        self, token: str, host: str, threads: int, command: list[str], timeout: float
    ) -> None:
        """The keeper thread: starts the server (tied to this thread, which lives as long as the
        server does), then waits for it to exit."""

        def echo(line: str) -> None:
            print(f"[ferrograph serve] {line}", file=sys.stderr)

        try:
            started = start_server(
                token,
                command=command,
                host=host,
                n_threads=threads,
                timeout=timeout,
                echo=echo,
                tie_to_thread=True,  # ties the server to this actor
            )
        except Error as error:
            self._failure = str(error)
            self._ready.set()
            return
        proc = started.process
        self._proc = proc
        self.pid = proc.pid
        if self._stopping.is_set():  # __init__ gave up waiting and stopped before it started
            self.stop()
            return
        bound, _, port = started.address.rpartition(":")
        # a server bound to every interface is reached at its node's address
        wildcard = bound in ("0.0.0.0", "[::]", "::")
        self.endpoint = f"{self.node_ip}:{port}" if wildcard else started.address
        self._ready.set()
        code = proc.wait()
        if not self._stopping.is_set() and self.endpoint:
            print(
                f"[ferrograph] server {self.endpoint} exited with status {code}: ending its actor",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

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

        ray: Any = import_ray()
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
