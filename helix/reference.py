"""The field reference of Helix's files, rendered from their pydantic models (docs/config.md).

``docs/config.md`` is prose written by hand around generated field tables. Each table block
sits between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``, one block
per file format (:data:`BLOCKS`), and holds one table per model reachable from the file's root
model: every field with its type and constraints, its default and its description (the
``description=`` of the field, units included). :func:`update_document` re-renders the blocks
and leaves the prose alone; a test fails when the document drifts from the models. Regenerate
with::

    python -m helix.reference docs/config.md          # rewrite the blocks
    python -m helix.reference --check docs/config.md  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from helix.tasks import PETFileConfig

# block name -> the root model of that file format
BLOCKS: dict[str, type[BaseModel]] = {"cluster": ClusterSpec, "profiles": ProfileSet, "plan": Plan,
                                      "task": PETFileConfig}

BEGIN = "<!-- BEGIN generated: {name} (python -m helix.reference docs/config.md) -->"
END = "<!-- END generated: {name} -->"

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


def _members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def models_of(root: type[BaseModel]) -> list[type[BaseModel]]:
    """``root`` and every model its fields reach, in the order a reader meets them."""
    found: list[type[BaseModel]] = [root]
    for model in found:  # grows while iterating: breadth first
        for info in model.model_fields.values():
            stack = [info.annotation]
            while stack:
                annotation = stack.pop(0)
                if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                    if annotation not in found:
                        found.append(annotation)
                else:
                    stack += [a for a in typing.get_args(annotation) if a is not Ellipsis]
    return found


def anchor(model: type[BaseModel]) -> str:
    """The Markdown anchor of a model's heading (``#### NodeSpec`` -> ``nodespec``)."""
    return model.__name__.lower()


def type_text(annotation: Any) -> str:
    """A field's type in words a YAML writer knows (``list of [number, number]``)."""
    if annotation is type(None):
        return "null"
    if _is_model(annotation):
        return f"[{annotation.__name__}](#{anchor(annotation)})"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in args if a is not type(None))
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict:
        return f"map of name to {type_text(args[1])}"
    return str(annotation).replace("typing.", "")


def constraints_text(info: FieldInfo) -> list[str]:
    """``gt=0`` -> ``> 0`` and the like, from the field's metadata (pydantic's annotated-types)."""
    out = []
    for meta in info.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                out.append(f"{symbol} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            out.append("not empty" if meta.min_length == 1 else f"at least {meta.min_length} long")
        if getattr(meta, "max_length", None) is not None:
            out.append(f"at most {meta.max_length} long")
    return out


def default_text(info: FieldInfo) -> str:
    """``**required**``, ``absent`` (None), or the default as YAML would spell it."""
    if info.is_required():
        return "**required**"
    default = info.get_default(call_default_factory=True)
    if default is None:
        return "absent"
    if isinstance(default, BaseModel):
        return "all its defaults"
    if isinstance(default, str):
        return f"`{default}`"
    return f"`{json.dumps(default)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(model: type[BaseModel]) -> str:
    """The model's docstring (its first paragraph), in Markdown's backticks."""
    doc = model.__dict__.get("__doc__") or ""
    first = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


def model_table(model: type[BaseModel]) -> str:
    """One model: heading, docstring and a table of its fields."""
    lines = [f"#### {model.__name__}", ""]
    if doc := _doc(model):
        lines += [doc, ""]
    lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        kind = ", ".join([type_text(info.annotation), *constraints_text(info)])
        lines.append(f"| `{name}` | {_cell(kind)} | {_cell(default_text(info))} | {_cell(info.description or '')} |")
    return "\n".join(lines)


def render_block(name: str) -> str:
    """The generated text of one block (without its markers)."""
    return "\n\n".join(model_table(m) for m in models_of(BLOCKS[name]))


def _block_pattern(name: str) -> re.Pattern[str]:
    begin, end = BEGIN.format(name=name), END.format(name=name)
    return re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)


def update_document(text: str) -> str:
    """``text`` with every generated block re-rendered; the prose around them is kept."""
    for name in BLOCKS:
        match = _block_pattern(name).search(text)
        if match is None:
            raise ValueError(f"no generated block {name!r}: add the lines {BEGIN.format(name=name)!r} and "
                             f"{END.format(name=name)!r} where its tables belong")  # fmt: skip
        fresh = f"{BEGIN.format(name=name)}\n\n{render_block(name)}\n\n{END.format(name=name)}"
        text = text[: match.start()] + fresh + text[match.end() :]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helix.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", default="docs/config.md", help="the document with the generated blocks")
    parser.add_argument("--check", action="store_true", help="only say whether the blocks are stale (exit 1)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    text = path.read_text(encoding="utf-8")
    fresh = update_document(text)
    if args.check:
        if fresh != text:
            print(f"{path}: the generated field tables are stale; run python -m helix.reference {path}")
            return 1
        return 0
    if fresh != text:
        path.write_text(fresh, encoding="utf-8")
        print(f"{path}: field tables regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
