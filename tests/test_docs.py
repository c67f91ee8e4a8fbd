"""The user docs stay true to the checkout.

README.md and docs/*.md are what a user reads first, so they must not send anyone to a file
the clone does not have, nor show a command or an option the CLI does not accept:

* every relative link (and its ``#anchor``) in README.md, docs/*.md and docs/notes/*.md
  resolves to a file of the checkout;
* every ``helix COMMAND`` in a code block or inline code span of README.md and docs/*.md is
  one of ``helix.cli.COMMANDS`` (read from the source, so a command that fails to import
  still counts), and every ``--option`` on that line is one that command's parser accepts.

The checkers are tested on fabricated text first, so a checker that can no longer fail
fails here.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTES = sorted((ROOT / "docs" / "notes").glob("*.md"))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
PROGRAM = re.compile(r"^(?:\$\s+)?(?:\S*/bin/|\./)?helix(?=\s|$)")
LONG_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHORT_OPTION = re.compile(r"(?<![\w-])-[a-zA-Z](?=[\s\]=,|)]|$)")


# ---------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, markdown: str, root: Path) -> list[str]:
    """Relative links of ``markdown`` (the text of ``doc``) that point nowhere in ``root``."""
    prose = INLINE_CODE.sub("", FENCE.sub("", markdown))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = doc if not path_part else (doc.parent / path_part).resolve()
        if root not in dest.parents and dest != root:
            problems.append(f"{doc.name}: {target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{doc.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md":
            text = markdown if dest == doc else dest.read_text(encoding="utf-8")
            if anchor not in anchors(text):
                problems.append(f"{doc.name}: {target}: no heading with the anchor #{anchor}")
    return problems


# ---------------------------------------------------------------- commands


def cli_commands() -> set[str]:
    """The keys of ``COMMANDS`` in helix/cli.py, read from the source."""
    tree = ast.parse((ROOT / "helix" / "cli.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "COMMANDS":
            return set(ast.literal_eval(value))
    raise AssertionError("helix/cli.py has no COMMANDS table")


def command_lines(markdown: str) -> list[str]:
    """``helix ...`` command lines: in code blocks (joining ``\\`` and indented ``[`` continuation
    lines, dropping ``# comments``) and in inline code spans."""
    lines: list[str] = []
    for block in FENCE.finditer(markdown):
        current: str | None = None
        continued = False
        for raw in block.group(0).splitlines()[1:-1]:
            line = re.sub(r"\s+#.*$", "", raw).rstrip()
            if current is not None and (continued or re.match(r"^\s+[\[-]", line)):
                current += " " + line.strip().rstrip("\\")
            else:
                if current is not None:
                    lines.append(current)
                current = line.strip().rstrip("\\") if PROGRAM.match(line.strip()) else None
            continued = line.endswith("\\")
        if current is not None:
            lines.append(current)
    for span in INLINE_CODE.findall(FENCE.sub("", markdown)):
        code = span.strip("`")
        if PROGRAM.match(code):
            lines.append(code)
    return lines


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def bad_commands(markdown: str, commands: set[str], parsers: dict[str, argparse.ArgumentParser] | None,
                 top_options: set[str]) -> list[str]:
    """Command lines naming a command that does not exist, or an option it does not take
    (options are checked only when ``parsers`` is given)."""
    problems = []
    for line in command_lines(markdown):
        words = PROGRAM.sub("", line).split()
        name = next((w for w in words if not w.startswith("-")), None)
        leading = [w.split("=")[0] for w in words[: words.index(name)]] if name else [w.split("=")[0] for w in words]
        for opt in leading:
            if opt.startswith("-") and opt not in top_options:
                problems.append(f"`{line}`: helix has no option {opt}")
        if name is None or not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            continue  # `helix --help`, or a placeholder such as `helix COMMAND`
        if name not in commands:
            problems.append(f"`{line}`: no command `helix {name}` (helix/cli.py COMMANDS: {', '.join(sorted(commands))})")
            continue
        if parsers is None or name not in parsers:
            continue
        rest = line[line.index(name) + len(name):]
        known = option_strings(parsers[name])
        for opt in sorted(set(LONG_OPTION.findall(rest)) | set(SHORT_OPTION.findall(rest))):
            if opt not in known:
                problems.append(f"`{line}`: `helix {name}` has no option {opt}")
    return problems


@pytest.fixture(scope="module")
def cli() -> tuple[dict[str, argparse.ArgumentParser], set[str]]:
    from helix.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices), option_strings(parser)


# ---------------------------------------------------------------- the checkers catch what they should


def test_link_checker_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The `helix show` picture\n")
    doc = tmp_path / "docs" / "page.md"
    text = (
        "# Page\n\nSee [there](other.md#the-helix-show-picture), [here](#page), [web](https://x.org/a),\n"
        "[gone](missing.md), [bad anchor](other.md#nowhere), [design](../../DESIGN.md).\n\n"
        "```\n[in code](also-missing.md)\n```\n"
    )
    doc.write_text(text)
    problems = broken_links(doc, text, tmp_path)
    assert len(problems) == 3, problems
    assert any("missing.md: no such file" in p for p in problems)
    assert any("#nowhere" in p for p in problems)
    assert any("DESIGN.md" in p and "outside" in p for p in problems)


def test_command_checker_finds_unknown_commands_and_options(cli: tuple[dict, set[str]]) -> None:
    parsers, top = cli
    text = (
        "```sh\n"
        "helix plan clusters/demo/cluster.yaml --time-limit 5 -o plan.json   # --not-checked in a comment\n"
        "helix plan CLUSTER [--method M] [--no-partial]\n"
        "                   [--bogus-flag]\n"
        ".venv/bin/helix simulate C P \\\n    --duration 10 --no-such-option\n"
        "helix frobnicate --x\n"
        "make demo\n"
        "```\n\n"
        "Inline: `helix evaluate C P --no-partial`, `helix teleport`, `helix --nonsense`.\n"
    )
    problems = bad_commands(text, cli_commands(), parsers, top)
    assert len(problems) == 5, problems
    assert any("--bogus-flag" in p for p in problems)
    assert any("--no-such-option" in p for p in problems)
    assert any("helix frobnicate" in p for p in problems)
    assert any("helix teleport" in p for p in problems)
    assert any("--nonsense" in p for p in problems)


def test_commands_table_is_read_from_the_source() -> None:
    from helix.cli import COMMANDS

    assert cli_commands() == set(COMMANDS) and {"plan", "serve", "agent"} <= cli_commands()


# ---------------------------------------------------------------- the docs


@pytest.mark.parametrize("doc", USER_DOCS + NOTES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc, doc.read_text(encoding="utf-8"), ROOT) == []


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_and_options_exist(doc: Path, cli: tuple[dict, set[str]]) -> None:
    parsers, top = cli
    assert bad_commands(doc.read_text(encoding="utf-8"), cli_commands(), parsers, top) == []


def test_user_docs_do_not_send_users_to_files_outside_the_clone() -> None:
    for doc in USER_DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, f"{doc.name} mentions DESIGN.md, which a clone does not have"


def test_the_architecture_picture_is_drawn_from_the_imports(tmp_path: Path) -> None:
    """docs/architecture_figure.py draws the package imports it finds; each one is allowed by the
    dependency table, and the page shows the picture."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("architecture_figure", ROOT / "docs" / "architecture_figure.py")
    assert spec is not None and spec.loader is not None
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    drawn = figure.draw(tmp_path / "a.svg")
    assert ("router", "helix") in drawn and ("simulator", "router") in drawn
    assert (tmp_path / "a.svg").read_text().count("<svg") == 1
    from tests.test_dependencies import ALLOWED_MODULES, TABLE

    def forbidden(a: str, b: str) -> bool:  # a package the table forbids, bar the few modules it names
        return b in TABLE[a][0] and b not in {m.split(".")[0] for m in ALLOWED_MODULES.get(a, set())}

    assert not [(a, b) for a, b in drawn if forbidden(a, b)], "the picture shows an import the table forbids"
    # the dashed arrows are the table's narrow exceptions
    assert set(figure.NARROW) == {(a, m.split(".")[0]) for a, ms in ALLOWED_MODULES.items() for m in ms}
    assert all(module.split("/")[0] in figure.PACKAGES or module == "client" for module, _ in figure.ROUTE)
    assert all((ROOT / module).is_file() for module, _ in figure.ROUTE if module != "client")
    assert "](architecture.svg)" in (ROOT / "docs" / "architecture.md").read_text()
