"""The documentation: docs/ builds with mkdocs without a warning (a broken link or anchor, a
page missing from the nav), its generated pages are what the code generates now, every error
class has an entry, the README's links resolve, and the own-loop example runs."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import autoplan.errors
from autoplan.errors import AutoplanError

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = (sys.executable, "-m", "mkdocs", "build", "--strict")


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_build_strictly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*MKDOCS, "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "options.html").exists()


def test_options_page_is_generated_from_the_docstrings() -> None:
    page = (DOCS / "options.md").read_text()
    assert page == _tool("docs_options").render(), "run: python tools/docs_options.py"


def test_every_error_class_has_an_entry() -> None:
    classes = {
        name
        for name, cls in inspect.getmembers(autoplan.errors, inspect.isclass)
        if issubclass(cls, AutoplanError) and cls.__module__ == autoplan.errors.__name__
    }
    page = (DOCS / "troubleshooting.md").read_text()
    entries = set(re.findall(r"^### (\w+)$", page, re.MULTILINE))
    assert classes - entries == set(), "add an entry to docs/troubleshooting.md"
    assert entries - classes == set(), "an entry for a class autoplan.errors no longer has"


def test_readme_links_resolve_and_reach_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert [t for t in local if not (ROOT / t).exists()] == []
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")}
    assert pages - set(local) == set(), "link each docs page from the README"


def test_readme_is_a_guide() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_own_loop_example_parses() -> None:
    source = (ROOT / "examples" / "own_loop.py").read_text()
    tree = ast.parse(source)
    assert "main" in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
    compile(source, "examples/own_loop.py", "exec")


@pytest.mark.slow
def test_own_loop_example_trains_under_torchrun(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    run = [torchrun, "--nproc-per-node", "2", str(ROOT / "examples" / "own_loop.py")]
    args = ["--steps", "4", "--accumulate", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = subprocess.run(run + args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", first.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "saved" in first.stdout and "held-out loss" in first.stdout
    args[1] = "6"  # resumed from step 4: two more steps, from where the loader was
    again = subprocess.run(run + args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.findall(r"step (\d+): loss", again.stdout) == ["5", "6"]
