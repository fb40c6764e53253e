"""ferrograph.distributed on a local Ray cluster: launch time, weights to many servers, MiniLM.

Run with ``python benches/cluster.py`` (``--help`` for options). Everything runs on one
``ray.cluster_utils.Cluster`` made here: a head with 0 CPUs and ``--nodes`` worker nodes, all on
127.0.0.1, no dashboard, no usage stats. The machine's cores are shared by every node, so the
figures compare peers measured in the same run, not machines.

Sections (``--only``):

* ``launch``: the Ray cluster's start, then ``fg.distributed.launch(n, "STRICT_SPREAD")`` until
  every device is connected, and ``shutdown()``; best and median of ``--repeat`` rounds.
* ``weights``: (1) transport alone: the MiniLM weights (f32, every tensor of
  ``model.safetensors``) brought to one actor per node, through Ray's object store
  (``ray.put`` once, each actor ``ray.get`` and reads every byte) vs streamed from this process
  over a direct TCP socket to each actor; wall time until every actor holds every byte.
  (2) end to end: MiniLM's encoder layers placed on fresh servers (cold weight caches), the
  client uploading everything over TCP vs ``Cluster.preload_weights`` (object store, then each
  actor fills its server's weight cache over loopback) followed by the same placement.
* ``minilm``: batches of 32 sentences of 128 tokens, the layers split over two servers (one
  CPU each, STRICT_SPREAD) vs this process's CPU (2 threads, the peer), with 1, 2 and 4 batches
  in flight (one model and thread per batch in flight, on both sides); sentences/s.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def start_ray(n_nodes: int, cpus_per_node: int) -> tuple[Any, float]:
    from ferrograph.distributed._ray import start_loopback_cluster

    start = time.perf_counter()
    # (the home directory, a few bytes in the temp directory, outlives the bench's Ray)
    cluster, _, _ = start_loopback_cluster(n_nodes, cpus_per_node)
    return cluster, time.perf_counter() - start


# ----- launch -----------------------------------------------------------------------------


def bench_launch(n_servers: int, repeat: int) -> None:
    import ferrograph as fg

    launches, shutdowns = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        cluster = fg.distributed.launch(n_servers, strategy="STRICT_SPREAD")
        launches.append(time.perf_counter() - start)
        start = time.perf_counter()
        cluster.shutdown()
        shutdowns.append(time.perf_counter() - start)
    print(
        f"launch {n_servers} servers (STRICT_SPREAD, connected): best {min(launches):.2f} s, "
        f"median {statistics.median(launches):.2f} s; shutdown median "
        f"{statistics.median(shutdowns):.2f} s ({repeat} rounds)"
    )


# ----- weights ----------------------------------------------------------------------------


class Receiver:
    """An actor that receives weights either way and reads every byte (as an upload would)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]

    def address(self) -> int:
        return int(self.port)

    def from_object_store(self, refs: list[Any]) -> float:
        import ray

        arrays: dict[str, np.ndarray] = ray.get(refs[0])
        return float(sum(float(a.view(np.uint8)[::4096].sum()) for a in arrays.values()))

    def from_tcp(self) -> float:
        conn, _ = self._listener.accept()
        with conn:
            total = 0.0
            header = conn.recv(8, socket.MSG_WAITALL)
            (size,) = struct.unpack("<Q", header)
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                n = conn.recv_into(view[got:], size - got)
                if n == 0:
                    raise ConnectionError("sender went away")
                got += n
            total = float(np.frombuffer(buf, np.uint8)[::4096].sum())
            conn.sendall(b"k")
        return total


def load_minilm_arrays() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from ferrograph.models import find_model_dir

    path = Path(find_model_dir()) / "model.safetensors"
    return {k: np.ascontiguousarray(v, np.float32) for k, v in load_file(str(path)).items()}


def bench_weights(n_receivers: int, repeat: int) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    arrays = load_minilm_arrays()
    nbytes = sum(a.nbytes for a in arrays.values())
    blob = b"".join(a.tobytes() for a in arrays.values())
    pg = placement_group([{"CPU": 1}] * n_receivers, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    cls = ray.remote(Receiver)
    actors = [
        cls.options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(n_receivers)
    ]
    ports = ray.get([a.address.remote() for a in actors])
    store, tcp = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        ref = ray.put(arrays)
        ray.get([a.from_object_store.remote([ref]) for a in actors])
        store.append(time.perf_counter() - start)
        del ref

        start = time.perf_counter()
        pending = [a.from_tcp.remote() for a in actors]

        def send(port: int) -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(struct.pack("<Q", len(blob)))
                s.sendall(blob)
                s.recv(1)

        threads = [threading.Thread(target=send, args=(p,)) for p in ports]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ray.get(pending)
        tcp.append(time.perf_counter() - start)
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    mib = nbytes / 2**20
    s_best, t_best = min(store), min(tcp)
    print(
        f"weights ({mib:.1f} MiB f32) to {n_receivers} actors on {n_receivers} nodes: "
        f"object store best {s_best * 1e3:.0f} ms (median {statistics.median(store) * 1e3:.0f}), "
        f"direct TCP best {t_best * 1e3:.0f} ms (median {statistics.median(tcp) * 1e3:.0f}); "
        f"object store / TCP = {s_best / t_best:.2f}"
    )


def bench_weights_upload(n_servers: int, repeat: int) -> None:
    """MiniLM's encoder layers placed on ``n_servers`` fresh servers (cold weight caches): the
    client uploads every weight over TCP, vs ``Cluster.preload_weights`` through the object
    store first (the client's writes of 1 MiB or more then send only their hashes)."""
    import ferrograph as fg
    from ferrograph.models import MiniLM

    times: dict[str, list[float]] = {"tcp": [], "object store": []}
    for _ in range(repeat):
        for way in times:
            model = MiniLM(n_threads=1)
            with fg.distributed.launch(n_servers, strategy="STRICT_SPREAD") as cluster:
                servers = [ds[0] for ds in cluster.devices_per_server]
                start = time.perf_counter()
                if way == "object store":
                    cluster.preload_weights(model)
                model.place_layers(servers)
                times[way].append(time.perf_counter() - start)
                del model, servers
    tcp, store = min(times["tcp"]), min(times["object store"])
    print(
        f"MiniLM layers placed on {n_servers} fresh servers: client upload over TCP best "
        f"{tcp * 1e3:.0f} ms (median {statistics.median(times['tcp']) * 1e3:.0f}), object store "
        f"+ warm cache best {store * 1e3:.0f} ms (median "
        f"{statistics.median(times['object store']) * 1e3:.0f}); object store / TCP = "
        f"{store / tcp:.2f}"
    )


# ----- MiniLM -----------------------------------------------------------------------------


def _throughput(models: list[Any], sentences: list[str], repeat: int) -> float:
    """Sentences per second with one thread per model, each encoding ``sentences`` (one batch)
    ``repeat`` times: ``len(models)`` batches in flight."""
    barrier = threading.Barrier(len(models) + 1)
    errors: list[BaseException] = []

    def run(model: Any) -> None:
        barrier.wait()
        try:
            for _ in range(repeat):
                model.encode(sentences, batch_size=len(sentences))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return len(models) * repeat * len(sentences) / elapsed


def bench_minilm(repeat: int, copies: list[int]) -> None:
    """Each copy in flight is a model of its own (its own scheduler, graphs and weights) run by
    a thread of its own; the servers compute whichever batch reaches them, so server 1 works
    on one batch's first layers while server 2 works on another's last."""
    import inspect

    import ferrograph as fg
    from ferrograph.models import MiniLM

    if "devices" not in inspect.signature(MiniLM).parameters:
        print("minilm: skipped (the models have no devices= layer placement in this build)")
        return
    sentences = [" ".join(["word"] * 126)] * 32  # 128 tokens with [CLS] and [SEP]
    local = MiniLM(n_threads=2, max_length=128)
    assert local.tokenize(sentences[:1]).shape == (1, 128)
    local.encode(sentences)
    peers = {}
    for n in copies:
        models = [local] + [MiniLM(n_threads=2, max_length=128) for _ in range(n - 1)]
        for m in models:
            m.encode(sentences)
        peers[n] = _throughput(models, sentences, repeat)
        print(f"minilm 32x128 local process (2 threads), {n} in flight: {peers[n]:.1f} sentences/s")
    with fg.distributed.launch(2, cpus_per_server=1, strategy="STRICT_SPREAD") as cluster:
        servers = [ds[0] for ds in cluster.devices_per_server]
        for n in copies:
            models = [MiniLM(n_threads=1, max_length=128, devices=servers) for _ in range(n)]
            for m in models:
                m.encode(sentences)
            rate = _throughput(models, sentences, repeat)
            print(
                f"minilm 32x128 split over 2 servers (1 CPU each), {n} in flight: "
                f"{rate:.1f} sentences/s (split / local with {n} in flight = "
                f"{rate / peers[n]:.2f}; / local with 1 = {rate / peers[copies[0]]:.2f})"
            )


def importlib_spec(name: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="launch,weights,minilm")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--copies", default="1,2,4", help="batches in flight (default 1,2,4)")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    cluster, started = start_ray(args.nodes, cpus_per_node=2)
    print(f"local Ray cluster (head + {args.nodes} worker nodes on 127.0.0.1): {started:.1f} s")
    try:
        if "launch" in sections:
            bench_launch(args.nodes, args.repeat)
        if "weights" in sections:
            bench_weights(args.nodes, args.repeat)
            bench_weights_upload(args.nodes, args.repeat)
        if "minilm" in sections:
            bench_minilm(args.repeat, [int(n) for n in args.copies.split(",")])
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
