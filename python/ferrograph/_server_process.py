"""Running ``ferrograph serve`` as a child process: the one code path behind
:func:`ferrograph.remote.spawn_server` and the Ray actors of :mod:`ferrograph.distributed`.

:func:`start_server` builds the command line, hands the token over in the child's environment
(never on its command line, which other users of the machine can read), waits for the
``host:port`` the server prints as its first line, and keeps draining the child's output so it
never blocks on a full pipe. Every way of failing to start raises
:class:`ferrograph.BackendError`, with the tail of the server's stderr in the message.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import BackendError, InvalidArgumentError

SERVER_COMMAND_ENV = "FERROGRAPH_SERVER_COMMAND"
"""Environment variable naming the server command line (shell words), e.g. an installed
``ferrograph serve`` binary; read by :func:`default_server_command`."""

STDERR_TAIL_LINES = 40
"""How many of the server's last stderr lines a start failure quotes."""


def default_server_command() -> list[str]:
    """The server command before its options: ``$FERROGRAPH_SERVER_COMMAND`` when set, else
    ``python -m ferrograph serve`` with this interpreter (Ray's workers run the same one)."""
    configured = os.environ.get(SERVER_COMMAND_ENV, "").strip()
    if configured:
        return shlex.split(configured)
    return [sys.executable, "-m", "ferrograph", "serve"]


def parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a function to run in the server's child process before exec that asks the
    kernel to kill it when the thread that started it goes away. Resolved here, in the parent,
    so the child only makes one call. ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def in_child() -> None:  # pragma: no cover - runs between fork and exec
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    return in_child


def check_server_args(
    port: int, n_threads: int | None, timeout: float, peers: Sequence[str] | None = None
) -> None:
    """Raises :class:`ferrograph.InvalidArgumentError` for options the server would refuse."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int from 0 to 65535, got {port!r}")
    if n_threads is not None and (
        isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1
    ):
        raise InvalidArgumentError(f"n_threads must be a positive int, got {n_threads!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    for peer in peers or ():
        if not isinstance(peer, str) or "," in peer or not peer.strip():
            raise InvalidArgumentError(f'peers expects "ip:port" strings, got {peer!r}')


def server_argv(
    command: Sequence[str],
    host: str,
    port: int = 0,
    n_threads: int | None = None,
    peers: Sequence[str] | None = None,
) -> list[str]:
    """The full command line: ``command`` followed by the serve options."""
    argv = [*command, "--host", host, "--port", str(port)]
    if n_threads is not None:
        argv += ["--threads", str(n_threads)]
    if peers:
        argv += ["--peers", ",".join(peers)]
    return argv


@dataclass
class StartedServer:
    """A server process that printed its address (what :func:`start_server` returns)."""

    process: subprocess.Popen[str]
    address: str
    """The ``host:port`` the server printed (its bound address, maybe a wildcard)."""
    argv: list[str]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    """The server's last stderr lines (kept up to date while it runs)."""


def _is_endpoint(line: str) -> bool:
    bound, _, port = line.rpartition(":")
    return bool(bound) and port.isdigit()


def start_server(
    token: str,
    *,
    command: Sequence[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    n_threads: int | None = None,
    peers: Sequence[str] | None = None,
    timeout: float = 30.0,
    echo: Callable[[str], None] | None = None,
    tie_to_thread: bool = False,
) -> StartedServer:
    """Starts a device server and waits until it prints its address.

    ``command`` is the command before the options (:func:`default_server_command` when
    ``None``). Every later line the server writes (stdout after the address, and stderr) is
    passed to ``echo`` from a reader thread; the last :data:`STDERR_TAIL_LINES` stderr lines
    are also kept in :attr:`StartedServer.stderr_tail`. With ``tie_to_thread`` (Linux) the
    server is killed when the calling thread ends.

    Raises
    ------
    ferrograph.InvalidArgumentError
        For a bad ``port``, ``n_threads``, ``timeout`` or ``peers``.
    ferrograph.BackendError
        If the command cannot be run, or the server exits or prints no ``host:port`` within
        ``timeout`` seconds (the port is taken, a bad option, ...); the server is then killed.
    """
    check_server_args(port, n_threads, timeout, peers)
    argv = server_argv(
        command if command is not None else default_server_command(), host, port, n_threads, peers
    )
    env = dict(os.environ, FERROGRAPH_TOKEN=token)
    try:
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=parent_death_signal() if tie_to_thread else None,
        )
    except OSError as error:
        raise BackendError(f"cannot run the device server ({shlex.join(argv)}): {error}") from None
    tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
    first: list[str] = []
    printed = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        first.append(process.stdout.readline().strip())
        printed.set()
        for line in process.stdout:
            if echo is not None:
                echo(line.rstrip())

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            tail.append(line.rstrip())
            if echo is not None:
                echo(line.rstrip())

    stderr_reader = threading.Thread(target=read_stderr, name="ferrograph-serve-stderr")
    stderr_reader.daemon = True
    stderr_reader.start()
    stdout_reader = threading.Thread(target=read_stdout, name="ferrograph-serve-stdout")
    stdout_reader.daemon = True
    stdout_reader.start()
    printed.wait(timeout)
    address = first[0] if first else ""
    if _is_endpoint(address):
        return StartedServer(process, address, argv, tail)

    if not printed.is_set():
        why = f"it printed no address within {timeout:g} s"
    elif not address:
        try:
            code = process.wait(5.0)
            why = f"it exited with status {code}"
        except subprocess.TimeoutExpired:
            why = "it closed its output without printing an address"
    else:
        why = f"it printed {address!r} instead of host:port"
    if process.poll() is None:
        process.kill()
        process.wait()
    stderr_reader.join(2.0)  # the last lines, written just before the exit
    lines = "\n".join(tail)
    raise BackendError(
        f"the device server ({shlex.join(argv)}) did not start: {why}"
        + (f"\nits stderr:\n{lines}" if lines else "")
    )
