"""Each setting declared once (issue 53, item 5): argparse, ``kvledger serve --help`` and
docs/settings.md come from the dataclass fields made with ``config.setting``; the page is current, every
setting is declared, and the choices some subsystems keep agree with the declarations."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

from kvledger import cli, config
from kvledger.config import EngineConfig, LaunchSettings, ServerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_docs_settings_table_is_current():
    text = DOC.read_text()
    m = re.search(r"<!-- settings:[^\n]*-->\n(.*?)<!-- /settings -->", text, re.S)
    assert m, "docs/settings.md lacks the settings markers"
    assert m.group(1) == config.settings_markdown(), "regenerate: python -m kvledger.config --write"


def test_every_setting_is_declared_with_a_flag_and_its_help():
    """No field of a section, of ServerConfig (but its engine) or of LaunchSettings without its
    declaration: a setting added as a plain field would have no flag, no help and no row."""
    for _, cls in config.SETTINGS_DOC_SECTIONS:
        for f in fields(cls):
            if cls is ServerConfig and f.name == "engine":
                continue
            flag = f.metadata.get("flag")
            assert isinstance(flag, config.Flag) and flag.help.strip(), f"{cls.__name__}.{f.name}"
    assert {s for s, _ in config.SETTINGS_DOC_SECTIONS} == {*EngineConfig.SECTIONS, "server", "launch"}


def test_serve_help_shows_every_declared_flag_with_its_help():
    """``kvledger serve --help`` is generated from the declarations: each option string is there, under
    its section's group, and a setting's help text with it."""
    parser = argparse.ArgumentParser(prog="kvledger serve")
    cli.add_server_args(parser)
    cli.add_engine_args(parser)
    text = parser.format_help()
    groups = {g.title: g for g in parser._action_groups}
    for section, cls in config.SETTINGS_DOC_SECTIONS:
        group = groups[f"{section} settings"]
        dests = {a.dest for a in group._group_actions}
        for f, flag in config.declared(cls):
            assert f.name in dests, (section, f.name)
            for opt in flag.options(f.name):
                assert re.search(rf"(^|[\s\[,]){re.escape(opt)}([\s\],=]|$)", text, re.M), opt
            assert " ".join(flag.help.split()[:4]) in " ".join(text.split()), f.name


def test_choices_kept_elsewhere_agree_with_the_declarations():
    """The tool-call parsers, the pooling methods: their subsystems keep them (the server's parsers,
    common/pooling.py); the declarations copy them so that config imports none of the project."""
    from kvledger.common.pooling import POOLING_METHODS
    from kvledger.server.tools import PARSERS

    assert tuple(sorted(PARSERS)) == config.TOOL_CALL_PARSERS
    assert tuple(POOLING_METHODS) == config.POOLINGS
    assert LaunchSettings().router_policy in config.ROUTER_POLICIES


def test_the_readme_is_short_and_its_links_resolve():
    """README.md: what it is, the two commands, a first request, the matrix, links (at most 200 lines);
    the rest lives in docs/ and bench/RESULTS.md, and every relative link points at a file."""
    root = DOC.parents[1]
    text = (root / "README.md").read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (root / target).exists(), target
