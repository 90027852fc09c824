"""Every third-party module ``src/`` imports is declared: a module-level import is a core dependency
(the README's first command installs no extra), and an optional feature's import is lazy and listed
in ``OPTIONAL`` with the extra that brings it. A new undeclared import fails here, not on a fresh
machine (issue 29: ``import msgpack`` at module level, pulled in only by the test extra)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvledger"

OPTIONAL = {
    # import name -> the extra that installs it; imported lazily where the feature starts, whose
    # absence is one error naming the extra (disagg/mooncake.py available(), server/dp_launcher.py)
    "mooncake": "mooncake",
    "sglang_router": "router",
    "triton": "cuda",
}


@dataclass(frozen=True)
class Import:
    module: str  # top-level name
    path: str
    line: int
    module_level: bool  # executed when the module is imported (not inside a function)


def _imports(path: Path, root: Path = ROOT) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            else:
                names = []
            rel = str(path.relative_to(root))
            found.extend(Import(n.split(".")[0], rel, child.lineno, not in_function) for n in names)
            visit(child, inner)

    visit(tree, False)
    return found


def _requirement_name(req: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(core dependencies, extra -> its dependencies), normalized distribution names, from pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11 to read pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_normalize(_requirement_name(r)) for r in project["dependencies"]}
    extras = {
        extra: {_normalize(_requirement_name(r)) for r in reqs}
        for extra, reqs in project.get("optional-dependencies", {}).items()
    }
    return core, extras


def undeclared(imports: list[Import], core: set[str], extras: dict[str, set[str]]) -> list[str]:
    """What is wrong with ``imports``, one line each (empty: all declared)."""
    dists = importlib.metadata.packages_distributions()
    problems = []
    for imp in imports:
        name = imp.module
        if name in sys.stdlib_module_names or name == "kvledger" or name == "__future__":
            continue
        where = f"{imp.path}:{imp.line}: import {name}"
        provided = {_normalize(d) for d in dists.get(name, [])}
        if provided & core:
            continue
        extra = OPTIONAL.get(name)
        if extra is None:
            problems.append(
                f"{where}: {', '.join(sorted(provided)) or 'an uninstalled package'} is not a core "
                "dependency in pyproject.toml (declare it, or import it lazily and list it in OPTIONAL)"
            )
        elif imp.module_level:
            problems.append(f"{where}: the optional extra [{extra}] must be imported lazily, where its feature starts")
        elif provided and not provided & extras.get(extra, set()):
            problems.append(f"{where}: extra [{extra}] does not declare {', '.join(sorted(provided))}")
    return problems


def test_every_import_of_src_is_declared():
    core, extras = _declared()
    imports = [imp for path in sorted(SRC.rglob("*.py")) for imp in _imports(path)]
    assert len({i.module for i in imports}) > 20  # the walk found the package's imports
    problems = undeclared(imports, core, extras)
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The walk sees imports at module level, in functions and under ``if``/``try``; the check refuses
    an undeclared one, an optional one at module level, and accepts the same lazily."""
    src = tmp_path / "src" / "kvledger"
    src.mkdir(parents=True)
    f = src / "m.py"
    f.write_text(
        "import os\nimport msgpack\ntry:\n    import numpy as np\nexcept ImportError:\n    pass\n"
        "import sglang_router\n\ndef start():\n    import sglang_router\n    from fastapi import FastAPI\n"
    )
    imports = _imports(f, tmp_path)
    assert [(i.module, i.module_level) for i in imports] == [
        ("os", True), ("msgpack", True), ("numpy", True), ("sglang_router", True),
        ("sglang_router", False), ("fastapi", False),
    ]  # fmt: skip
    core = {"numpy", "fastapi"}
    problems = undeclared(imports, core, {"router": {"sglang-router"}})
    assert len(problems) == 2, problems
    assert "import msgpack" in problems[0] and "not a core dependency" in problems[0]
    assert "import sglang_router" in problems[1] and "lazily" in problems[1]



def test_every_file_the_package_reads_at_run_time_is_package_data():
    """A non-editable install (a wheel) carries the kernels' C++ sources, which kernels/__init__.py
    builds at first use, and the dashboard's HTML: every such file matches a ``package-data`` pattern
    (before, the wheel had no csrc/ and an install from it silently ran without the kernels)."""
    import fnmatch

    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    needed = [*(SRC / "kernels" / "csrc").iterdir(), *(SRC / "server" / "static").glob("*.html")]
    assert needed
    for f in needed:
        if f.suffix not in (".cpp", ".h", ".html"):
            continue
        covered = any(
            fnmatch.fnmatch(str(f.relative_to(ROOT / "src" / Path(*pkg.split(".")))), pat)
            for pkg, pats in data.items()
            if f.is_relative_to(ROOT / "src" / Path(*pkg.split(".")))
            for pat in pats
        )
        assert covered, f"{f.relative_to(ROOT)} is in no package-data pattern of pyproject.toml"
