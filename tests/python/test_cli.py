"""The command line: usage without a sub-command, help text on every option, the demo runs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ferrograph.__main__ import build_parser, main


def sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_python_m_ferrograph_alone_prints_the_usage_and_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferrograph"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m ferrograph")
    for command in sub_parsers(build_parser()):
        assert command in result.stdout
    assert "error" not in result.stderr


def test_every_command_and_option_has_help_text() -> None:
    parser = build_parser()
    commands = sub_parsers(parser)
    assert {"demo", "embed"} <= set(commands)
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helped = {a.dest for a in choices._choices_actions if a.help}
    assert helped == set(commands), "a sub-command without help"
    for name, sub in commands.items():
        assert sub.description, f"{name} has no description"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.dest} has no help"
        text = sub.format_help()
        assert text.count("--") >= 2


def test_demo_runs_and_checks_against_numpy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--threads", "1", "--batch", "2", "--hidden", "32"]) == 0
    assert "ferrograph" in capsys.readouterr().out


def test_a_bad_option_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferrograph", "demo", "--batch", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "invalid int value" in result.stderr


def test_the_api_socket_is_tcp_so_asyncio_turns_nagle_off() -> None:
    """asyncio sets TCP_NODELAY only on connections whose socket's protocol is IPPROTO_TCP;
    with Nagle's algorithm on, every response waited ~40 ms for the client's delayed ACK."""
    import socket

    from ferrograph.__main__ import listening_socket

    server = listening_socket("127.0.0.1", 0)
    try:
        assert server.proto == socket.IPPROTO_TCP
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
        try:
            assert conn.proto == socket.IPPROTO_TCP  # what asyncio checks
        finally:
            conn.close()
            client.close()
    finally:
        server.close()
