"""The command line's surface, pinned: every option string, dest, default, type, nargs, choices, const,
action and mutually exclusive partner of ``kvledger serve`` and ``kvledger generate``, and the settings'
defaults. Written before the settings were declared once (issue 53, item 5), so that the declaration
that generates argparse, the dataclasses and the docs' table keeps every flag as it was.

Regenerate (only for a deliberate change of the surface): ``python -m tests.unit.test_cli_surface``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parent / "cli_surface.json"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from kvledger import cli

    captured: dict[str, argparse.ArgumentParser] = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):  # main() builds the parser, then parses: stop there
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                captured.update(action.choices)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab
    try:
        with contextlib.suppress(SystemExit):
            cli.main(["serve"])
    finally:
        argparse.ArgumentParser.parse_args = real
    return {k: v for k, v in captured.items() if k in ("serve", "generate")}


def _name(t) -> str | None:
    if t is None:
        return None
    return getattr(t, "__qualname__", repr(t))


def _jsonable(v):
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v != v:
        return "nan"
    return v


def surface() -> dict:
    """What the snapshot holds: each subcommand's actions in a stable order, and the settings' defaults."""
    from kvledger.config import EngineConfig, ServerConfig

    out: dict = {}
    for cmd, p in _subparsers().items():
        groups: dict[int, list[str]] = {}
        for g in p._mutually_exclusive_groups:
            for a in g._group_actions:
                groups.setdefault(id(a), []).extend(x.option_strings[0] for x in g._group_actions if x is not a)
        defaults = vars(p.parse_args(["x"] if cmd == "generate" else []))
        actions = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            actions.append(
                {
                    "options": list(a.option_strings),
                    "dest": a.dest,
                    "default": _jsonable(defaults.get(a.dest, a.default)),
                    "type": _name(a.type),
                    "nargs": a.nargs,
                    "choices": _jsonable(list(a.choices)) if a.choices is not None else None,
                    "const": _jsonable(a.const),
                    "action": type(a).__name__,
                    "required": a.required,
                    "metavar": a.metavar,
                    "exclusive_with": sorted(groups.get(id(a), [])),
                }
            )
        out[cmd] = sorted(actions, key=lambda x: (x["options"] or [x["dest"]])[0])
    out["engine_defaults"] = _jsonable(EngineConfig().flat())
    server = ServerConfig()
    out["server_defaults"] = {
        f.name: _jsonable(getattr(server, f.name)) for f in dataclasses.fields(ServerConfig) if f.name != "engine"
    }
    out["engine_sections"] = EngineConfig.section_of()
    return out


def test_the_command_line_surface_is_as_pinned():
    """A flag renamed, dropped, added or given another default/type/nargs/choices fails here, naming it."""
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(surface()))
    for key in ("engine_defaults", "server_defaults", "engine_sections"):
        assert got[key] == want[key], key
    for cmd in ("serve", "generate"):
        g = {tuple(a["options"]) or a["dest"]: a for a in got[cmd]}
        w = {tuple(a["options"]) or a["dest"]: a for a in want[cmd]}
        assert sorted(map(str, g)) == sorted(map(str, w)), (cmd, set(map(str, g)) ^ set(map(str, w)))
        for k, a in w.items():
            assert g[k] == a, (cmd, k, g[k], a)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    SNAPSHOT.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
