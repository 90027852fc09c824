"""The house's layers only point down (docs/overview.md): an AST walk of every import in
``src/kvledger`` and ``bench/`` (module level, inside functions, under ``TYPE_CHECKING``), failing
with the offending ``file:line``.

Three checks: (1) a package imports only packages of a lower layer than its own (so there is no
package cycle: two packages of one layer may not import each other either); (2) no circle of files,
in any package; (3) ``config`` imports nothing of the project but ``errors``. An import made through
``importlib`` is not seen (the project makes none of the project's own modules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

# Lowest first: each imports only those above it in this list. A top-level module counts as a
# package of its own (``compat.py`` is ``compat``); ``__init__`` is ``kvledger/__init__.py``.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),  # the exceptions every layer raises, in the OpenAI error shape; the version
    ("config",),  # plain settings types
    ("common", "compat", "connector"),  # types both processes share; the feature table; the connector contract
    # the ledger and pools; C++ kernels; grammars; collectives; images in (multimodal/)
    ("memory", "kernels", "constrained", "comm", "multimodal"),
    ("hicache", "model"),  # the cache tiers over the pools; the forward
    ("scheduler", "spec"),  # requests, batches, the one release path; draft proposers
    ("engine",),  # the step: schedule -> run -> update
    ("disagg", "testing"),  # PD connectors; fault injection around the executor
    ("parallel",),  # tensor-parallel ranks (they carry PD's and the tiers' per-step plans)
    ("launch",),  # the composition root, the engine process, the offline Engine
    ("server", "bench"),  # the HTTP front; the ``kvledger bench`` client
    ("cli", "__init__"),  # the command line; the package's face
    ("__main__",),  # ``python -m kvledger``
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

def _module_name(path: Path) -> str:
    base = SRC if path.is_relative_to(SRC) else ROOT
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    files = sorted((SRC / "kvledger").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    return {_module_name(p): p for p in files}


MODULES = _files()


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def _reexports(pkg: str) -> dict[str, str]:
    """Names a package's ``__init__`` hands on, to the submodule that defines them."""
    out: dict[str, str] = {}
    tree = ast.parse(MODULES[pkg].read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{pkg}.{node.module}"
    return out


def _imports(mod: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of ``mod`` that names a module of this tree: ``from pkg
    import name`` resolves ``name`` through the package's re-exports to the file that holds it."""
    out: list[tuple[int, str]] = []
    here = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.name if a.name in MODULES or not path.is_relative_to(ROOT / "bench") else f"bench.{a.name}"
                if name in MODULES:
                    out.append((node.lineno, name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1] + ([node.module] if node.module else [])
                target = ".".join(base)
            else:
                target = node.module or ""
                if target not in MODULES and path.is_relative_to(ROOT / "bench"):
                    target = f"bench.{target}"  # a script beside it (bench/ runs with itself on the path)
            names = _reexports(target) if _is_package(target) else {}
            for a in node.names:
                sub = f"{target}.{a.name}"  # a submodule (of a package, or of a folder without __init__)
                found = sub if sub in MODULES else names.get(a.name, target)
                if found in MODULES:
                    out.append((node.lineno, found))
    return sorted({(line, t) for line, t in out if t != mod})


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _package(mod: str) -> str | None:
    """The layer-bearing package of a module of ``src/kvledger`` (None for bench/ scripts)."""
    parts = mod.split(".")
    if parts[0] != "kvledger":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(ROOT)}:{line}"


def test_every_package_has_a_layer():
    missing = sorted({p for m in MODULES if (p := _package(m)) is not None and p not in RANK})
    assert not missing, f"packages with no layer in LAYERS (and docs/overview.md): {missing}"


def test_imports_only_point_down():
    bad = []
    for mod, imports in GRAPH.items():
        src = _package(mod)
        if src is None or src not in RANK:
            continue
        for line, target in imports:
            dst = _package(target)
            if dst is None or dst == src or dst not in RANK:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{_where(mod, line)}: {src} (layer {RANK[src]}) imports {target} (layer {RANK[dst]})")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_config_imports_nothing_of_the_project():
    bad = [
        f"{_where(mod, line)}: {target}"
        for mod, imports in GRAPH.items()
        if _package(mod) == "config"
        for line, target in imports
        if _package(target) not in ("errors", "config")  # (its own files: a package)
    ]
    assert not bad, "config imports the project:\n" + "\n".join(bad)


def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups = []
    edges = {m: sorted({t for _, t in imps}) for m, imps in GRAPH.items()}
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_circle_of_files():
    lines = []
    for group in _circles():
        members = set(group)
        lines.append("circle: " + ", ".join(group))
        for mod in group:
            lines += [f"  {_where(mod, line)} -> {t}" for line, t in GRAPH[mod] if t in members]
    assert not lines, "files that import each other in a circle:\n" + "\n".join(lines)


def test_the_walk_sees_lazy_and_type_checking_imports(tmp_path):
    """The walk is not blind: a lazy import inside a function, one under ``TYPE_CHECKING`` and one of
    a folder without ``__init__.py`` (``server/``) are all found, resolved to their files, and would
    be refused from the memory layer."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..engine.core import EngineCore\n"
        "def f():\n"
        "    from ..server import app\n"
        "    from ..scheduler import Scheduler\n"
    )
    found = {t for _, t in _imports("kvledger.memory.probe", probe)}
    assert found == {"kvledger.engine.core", "kvledger.server.app", "kvledger.scheduler.scheduler"}
    assert all(RANK[_package(t)] > RANK["memory"] for t in found)
