"""``helix --version``, and ``--help`` of every command: every option explained, every default shown."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

import helix
from helix.cli import COMMANDS, HelpFormatter, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"helix": parser, **sub.choices}


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text of ``action`` as ``--help`` prints it (defaults expanded)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def test_version_matches_the_package(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"helix {version}" == f"helix {helix.__version__}"


def test_every_command_is_built() -> None:
    assert set(subparsers()) == {"helix", *COMMANDS}


@pytest.mark.parametrize("name", ["helix", *COMMANDS])
def test_every_option_has_help_and_shows_its_default(name: str) -> None:
    parser = subparsers()[name]
    assert isinstance(parser._get_formatter(), HelpFormatter)
    problems = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        label = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            problems.append(f"{label}: no help text")
            continue
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or isinstance(action, argparse._CountAction):
            continue
        spelled = {str(default)}
        if isinstance(default, str) and Path(default).is_absolute() and Path(default).is_relative_to(ROOT):
            spelled.add(str(Path(default).relative_to(ROOT)))  # a path in the checkout, as the user sees it
        if not any(s in shown_help(parser, action) for s in spelled):
            problems.append(f"{label}: --help does not show its default {default!r}")
    assert not problems, f"helix {name}: " + "; ".join(problems)


def test_the_checks_above_can_fail() -> None:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    silent = parser.add_argument("--silent", type=int, default=3)
    stale = parser.add_argument("--stale", type=int, default=5, help="a number (default 4)")
    told = parser.add_argument("--told", type=int, default=7, help="a number")
    assert not silent.help
    assert "5" not in shown_help(parser, stale)
    assert shown_help(parser, told) == "a number (default: 7)"
