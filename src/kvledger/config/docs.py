"""docs/settings.md's tables, generated from the declared settings (``settings_markdown``), and the
writer of a document's generated parts (``write_generated``: the settings, the README's matrix)."""

from __future__ import annotations

from .base import (
    PAIR,
    SWITCH,
    TRISTATE,
    declared,
)
from .engine import _SECTION_TYPES, EngineConfig
from .server import LaunchSettings, ServerConfig

# Where each declared setting is documented: docs/settings.md's table, by section.
SETTINGS_DOC_SECTIONS: tuple[tuple[str, type], ...] = (
    *((s, _SECTION_TYPES[s]) for s in EngineConfig.SECTIONS),
    ("server", ServerConfig),
    ("launch", LaunchSettings),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def settings_markdown() -> str:
    """docs/settings.md's tables: every declared setting by section, with its flag(s), type, default and help."""
    out: list[str] = []
    for section, cls in SETTINGS_DOC_SECTIONS:
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        out += [f"### {section}", "", doc, "", "| flag | type | default | what |", "|---|---|---|---|"]
        for f, flag in declared(cls):
            opts = flag.options(f.name)
            names = " / ".join(f"`{o}`" for o in opts) if flag.kind in (PAIR, TRISTATE) else ", ".join(
                f"`{o}`" for o in opts
            )
            what = flag.help + (f"; {opts[1]}: {flag.help2}" if flag.help2 else "")
            if flag.choices:
                what += f" (one of: {', '.join(str(c) for c in flag.choices)})"
            typ = "bool" if flag.kind in (SWITCH, PAIR) else str(f.type).replace(" | None", "")
            out.append(f"| {names} | {typ} | `{f.default!r}` | {_cell(what)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_generated(path: str, marker: str, content: str) -> bool:
    """Put ``content`` between a document's ``<!-- MARKER: ... -->`` and ``<!-- /MARKER -->`` lines (the
    generated parts of docs/settings.md and of the README's matrix); True when the file changed."""
    import re

    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = re.sub(
        rf"(<!-- {marker}:[^\n]*-->\n)(.*?)(\n?<!-- /{marker} -->)",
        lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(3).lstrip("\n"),
        text,
        flags=re.S,
    )
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def write_settings_doc(path: str = "docs/settings.md") -> bool:
    """Put ``settings_markdown()`` between docs/settings.md's markers; True when it changed."""
    return write_generated(path, "settings", settings_markdown())
