"""Remote devices on loopback: MiniLM locally, on one device server, and split over two, in one run.

Run with ``python benches/remote.py`` (``--help`` for options). Two ``python -m ferrograph
serve`` children are started on 127.0.0.1 with the same thread count as the local model, so
the peers differ only in where the layers run. Cases: one 128-token sentence (1x128) and 32 of
them (32x128), best of ``--repeat`` calls (interleaved between the peers) after a warm-up call
(which uploads the graph to the servers' caches). Also measured:

* the bytes and time of one split boundary: a 128x384 f32 activation written to a remote
  tensor and read back (the round trip the scheduler makes when a split ends on another
  device), and the time per boundary implied by the end-to-end difference;
* a copy from one server to the other, direct (server to server) and through this process;
* ``n_copies`` 1, 2 and 4 for the split model (32 sentences in batches of 8);
* the weight upload: building the model with its layers on a server, cold (uploaded) and warm
  (a second client: the server's content-hash cache has them), vs locally.

The machine is shared: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ferrograph as fg
from ferrograph.models import minilm

TOKEN = "bench-remote-token"
WORDS = [
    "the",
    "history",
    "of",
    "computing",
    "is",
    "long",
    "and",
    "winding",
    "starting",
    "with",
    "mechanical",
    "calculators",
    "moving",
    "through",
    "vacuum",
    "tubes",
    "and",
    "transistors",
    "and",
    "arriving",
    "at",
    "integrated",
    "circuits",
]


def sentence(tokens: int, tokenizer: Any) -> str:
    """A sentence of exactly ``tokens`` tokens ([CLS] and [SEP] included), or near it."""
    words: list[str] = []
    i = 0
    while True:
        words.append(WORDS[i % len(WORDS)])
        i += 1
        n = len(tokenizer.encode(" ".join(words)).ids)
        if n >= tokens:
            return " ".join(words)


def best_ms_interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best time of each function, calls interleaved (a, b, c, a, b, c, ...) so that load
    from elsewhere on the machine hits every peer alike."""
    for fn in fns.values():
        fn()  # warm-up: graph built, memory reserved, graph cached on the servers
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: graph built, memory reserved, graph cached on the servers
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def boundary_roundtrip_ms(device: fg.Device, repeat: int) -> tuple[int, float]:
    """Bytes and best time of writing one 128x384 f32 activation and reading it back."""
    backend = device.init_backend()
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (128, 384))
    buffer = fg.alloc_ctx_tensors(ctx, backend)
    assert buffer is not None
    x = np.random.default_rng(0).standard_normal((128, 384)).astype(np.float32)

    def roundtrip() -> None:
        t.set(x)
        t.numpy()

    return t.nbytes, best_ms(roundtrip, max(repeat, 20))


def server_to_server_ms(
    a_address: str, b_address: str, nbytes: int, repeat: int
) -> tuple[float, float]:
    """Best time of copying ``nbytes`` from a tensor on server a to one on server b: directly
    (a pushes to b) and through this process (read from a, written to b)."""
    times = []
    for direct in (True, False):
        dev_a = fg.remote.connect(a_address, token=TOKEN, direct_copies=direct)[0]
        dev_b = fg.remote.connect(b_address, token=TOKEN, direct_copies=direct)[0]
        ba, bb = dev_a.init_backend(), dev_b.init_backend()
        actx, bctx = fg.Context(), fg.Context()
        src = actx.new_tensor(fg.float32, (nbytes // 4,))
        dst = bctx.new_tensor(fg.float32, (nbytes // 4,))
        keep = (fg.alloc_ctx_tensors(actx, ba), fg.alloc_ctx_tensors(bctx, bb))
        src.set(np.arange(nbytes // 4, dtype=np.float32))

        def copy(
            ba: fg.Backend = ba, bb: fg.Backend = bb, src: fg.Tensor = src, dst: fg.Tensor = dst
        ) -> None:
            fg.tensor_copy_async(ba, bb, src, dst)
            bb.synchronize()

        times.append(best_ms(copy, max(repeat, 10)))
        assert dst.numpy()[-1] == nbytes // 4 - 1
        del keep
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads, local and per server")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with (
        fg.remote.spawn_server(TOKEN, n_threads=args.threads) as b,
        # a pushes to b (direct copies); only allow-listed peers are reached
        fg.remote.spawn_server(TOKEN, n_threads=args.threads, peers=[b.address]) as a,
    ):
        dev_a = fg.remote.connect(a.address, token=TOKEN)[0]
        dev_b = fg.remote.connect(b.address, token=TOKEN)[0]

        start = time.perf_counter()
        local = minilm.MiniLM(n_threads=args.threads)
        local_load = time.perf_counter() - start
        start = time.perf_counter()
        one = minilm.MiniLM(n_threads=args.threads, devices=[dev_a])
        one_load = time.perf_counter() - start
        # A second client of the same server (a reconnect): its weights come from the
        # server's content-hash cache.
        again = fg.remote.connect(a.address, token=TOKEN)[0]
        start = time.perf_counter()
        warm = minilm.MiniLM(n_threads=args.threads, devices=[again])
        warm_load = time.perf_counter() - start
        del warm
        split = minilm.MiniLM(n_threads=args.threads, devices=[dev_a, dev_b])
        models = {"local": local, "one remote": one, "split over two": split}
        print(
            f"weights: {local.weights_nbytes / 2**20:.1f} MiB; model built locally in "
            f"{local_load * 1e3:.0f} ms; with every layer on a server: {one_load * 1e3:.0f} ms "
            f"(cold cache: uploaded), {warm_load * 1e3:.0f} ms (warm: a second client, weights "
            "from the server's cache)"
        )

        text = sentence(128, local.tokenizer)
        results: dict[str, dict[str, float]] = {}
        for case, n in (("1x128", 1), ("32x128", 32)):
            batch = local.tokenize([text] * n)
            assert batch.shape == (n, 128), batch.shape
            calls = {
                name: (lambda m=model, bt=batch: m.run_batch(bt)) for name, model in models.items()
            }
            results[case] = best_ms_interleaved(calls, args.repeat)
            row = results[case]
            print(
                f"{case}: local {row['local']:.1f} ms | one remote {row['one remote']:.1f} ms "
                f"({row['one remote'] / row['local']:.2f}x) | split over two "
                f"{row['split over two']:.1f} ms ({row['split over two'] / row['local']:.2f}x)"
            )
            for name in ("one remote", "split over two"):
                plan = models[name].split_plan
                assert plan is not None
                moves = [c for c in plan.copies if "@" in c["from_backend"] + c["to_backend"]]
                nbytes = sum(c["nbytes"] for c in moves)
                extra = row[name] - row["local"]
                print(
                    f"    {name}: {len(plan.splits)} splits, {len(moves)} copies to/from "
                    f"servers ({nbytes / 1e3:.0f} kB); {extra / max(len(moves), 1):.2f} ms "
                    "extra per copy"
                )

        nbytes, ms = boundary_roundtrip_ms(dev_a, args.repeat)
        print(f"one split boundary (write + read back {nbytes / 1e3:.0f} kB): {ms:.2f} ms")
        for size in (128 * 384 * 4, 32 * 128 * 384 * 4):
            direct, relayed = server_to_server_ms(a.address, b.address, size, args.repeat)
            print(
                f"server a -> server b, {size / 1e3:.0f} kB: direct {direct:.2f} ms, "
                f"through this process {relayed:.2f} ms"
            )

        sentences = [text] * 32
        for n_copies in (1, 2, 4):
            split.scheduler.n_copies = n_copies
            split._reserved = (0, 0)  # the scheduler forgot its reservation
            ms = best_ms(lambda: split.encode(sentences, batch_size=8), args.repeat)
            print(f"split over two, 32 sentences in batches of 8, n_copies={n_copies}: {ms:.0f} ms")


if __name__ == "__main__":
    main()
