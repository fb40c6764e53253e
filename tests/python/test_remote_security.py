"""Device server settings against hostile clients, from Python: the limits and the peer
allow-list reach the server, bad settings are clear errors, and the local ops the wire
validator shares refuse what would cut elements or run unbounded."""

from __future__ import annotations

import numpy as np
import pytest

import ferrograph as fg

TOKEN = "pytest-security-token-0123456789"


def test_limits_and_peers_are_settings() -> None:
    with fg.remote.RemoteServer(
        TOKEN, limits={"max_sessions": 1, "max_meta": 1 << 20}, peers=["127.0.0.1:9"]
    ) as server:
        first = fg.remote.connect(server.address, token=TOKEN)
        assert first
        # The one session allowed is taken: the next client hears that the server is busy.
        with pytest.raises(fg.BackendError, match="busy"):
            fg.remote.connect(server.address, token=TOKEN)
        del first
    with pytest.raises(fg.InvalidArgumentError, match="unknown server limit"):
        fg.remote.RemoteServer(TOKEN, limits={"max_everything": 1})
    with pytest.raises(fg.InvalidArgumentError, match="ip:port"):
        fg.remote.RemoteServer(TOKEN, peers=["somehost:80"])


def test_a_wrong_token_is_refused_without_details() -> None:
    with (
        fg.remote.RemoteServer(TOKEN) as server,
        pytest.raises(fg.InvalidArgumentError, match="authentication failed"),
    ):
        fg.remote.connect(server.address, token="not the token")


def test_group_norm_groups_are_bounded_by_the_channels() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (6, 3, 4))
    assert fg.ops.group_norm(a, 6, ctx=ctx) is not None
    for n_groups in (7, 2**62):
        with pytest.raises(fg.InvalidArgumentError, match="n_groups"):
            fg.ops.group_norm(a, n_groups, ctx=ctx)


def test_acc_refuses_strides_that_cut_elements() -> None:
    ctx = fg.Context()
    big = ctx.new_tensor(fg.float32, (8, 8))
    small = ctx.new_tensor(fg.float32, (2, 2))
    assert fg.ops.acc_ggml(big, small, 32, 64, 64, 8, ctx=ctx) is not None
    for nb1, offset in ((30, 8), (32, 6)):
        with pytest.raises(fg.ShapeError, match="multiples"):
            fg.ops.acc_ggml(big, small, nb1, 64, 64, offset, ctx=ctx)


def test_run_custom_on_unallocated_tensors_is_not_allocated() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (4,))
    y = fg.ops.custom(lambda dst, srcs: None, [a], fg.float32, (4,), ctx=ctx)
    with pytest.raises(fg.NotAllocatedError):
        fg.ops.run_custom(y)
    host = fg.Context(no_alloc=False)
    b = host.new_tensor(fg.float32, (4,))
    b.set(np.ones(4, np.float32))
    z = fg.ops.custom(lambda dst, srcs: None, [b], fg.float32, (4,), ctx=host)
    fg.ops.run_custom(z)
