"""Reading YAML/JSON files into pydantic models with errors that name the file and field.

Every file format of Helix (cluster, profiles, plan) is loaded through :func:`load_model`,
so a typo, a missing field or a wrong type becomes a :class:`ConfigError` saying
``clusters/x.yaml: nodes[3].gpu: Field required`` instead of a traceback. A file with several
problems reports all of them (up to :data:`MAX_PROBLEMS`), one per line, and an unknown field
names the closest known field at that place (``did you mean 'bandwidth_gbps'?``).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from helix.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

MAX_PROBLEMS = 10  # problems listed in one error; the rest are counted


def format_loc(loc: tuple[int | str, ...]) -> str:
    """``("nodes", 3, "gpu")`` -> ``nodes[3].gpu``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def read_document(path: Path) -> Any:
    """Parse a YAML or JSON file (by suffix; YAML via ``safe_load``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file: {exc.strerror}", source=str(path)) from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}", source=str(path)) from None


# -- where an error is: pydantic's location walked through the model's types -------------------


def _members(annotation: Any) -> list[Any]:
    """The non-None members of a union (``X | None`` -> ``[X]``); any other type as itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _tag(member: Any) -> str:
    """The name pydantic gives a union member in an error location (``str``, ``list[str]``)."""
    return member.__name__ if isinstance(member, type) else str(member).replace("typing.", "")


def _step(annotation: Any, part: int | str) -> tuple[list[Any], bool]:
    """The types found one location step below ``annotation``, and whether ``part`` was a real
    step (False: it only named which member of a union failed)."""
    members = _members(annotation)
    if isinstance(part, str) and len(members) > 1:
        tagged = [m for m in members if _tag(m) == part]
        if tagged:
            return tagged, False
    found: list[Any] = []
    for member in members:
        origin, args = typing.get_origin(member), typing.get_args(member)
        if isinstance(member, type) and issubclass(member, BaseModel) and isinstance(part, str):
            if part in member.model_fields:
                found.append(member.model_fields[part].annotation)
        elif origin is list and args and isinstance(part, int):
            found.append(args[0])
        elif origin is tuple and args and isinstance(part, int) and part < len(args):
            found.append(args[part])
        elif origin is dict and len(args) == 2:
            found.append(args[1])
    return found, True


def _resolve(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], list[Any]]:
    """``loc`` without union-member tags, and the types that hold its last part's container."""
    clean: list[int | str] = []
    here: list[Any] = [model]
    for part in loc:
        below: list[Any] = []
        real = True
        for annotation in here:
            found, real = _step(annotation, part)
            below += found
        if real:
            clean.append(part)
        here = below
    return tuple(clean), here


def _known_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The fields a mapping at ``loc`` (the container of an unknown key) may have."""
    _, holders = _resolve(model, loc)
    names: list[str] = []
    for holder in holders:
        for member in _members(holder):
            if isinstance(member, type) and issubclass(member, BaseModel):
                names += [n for n in member.model_fields if n not in names]
    return names


def problems(model: type[BaseModel], exc: ValidationError) -> list[tuple[str, str]]:
    """Every error of ``exc`` as ``(field, message)``: unknown fields with the closest known one,
    the failures of a union's members merged into one line."""
    out: dict[str, list[str]] = {}
    for err in exc.errors():
        raw = tuple(err["loc"])
        clean, _ = _resolve(model, raw)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and raw:
            known = _known_fields(model, raw[:-1])
            close = difflib.get_close_matches(str(raw[-1]), known, n=1, cutoff=0.6)
            msg = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
            if known and not close:
                msg += f" (known here: {', '.join(known)})"
        out.setdefault(format_loc(clean), []).append(msg)
    merged = []
    for field, messages in out.items():
        unique = list(dict.fromkeys(messages))
        rest = [m.removeprefix("Input should be ") for m in unique[1:]]
        merged.append((field, " or ".join([unique[0], *rest])))
    return merged


def validate(model: type[M], data: Any, source: str) -> M:
    """Validate ``data`` as ``model``; every error (up to :data:`MAX_PROBLEMS`) goes into one
    ConfigError naming the file, whose ``field`` is the first problem's field."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}", source=source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        found = problems(model, exc)
    if len(found) == 1:
        field, msg = found[0]
        raise ConfigError(msg, source=source, field=field or None)
    lines = [f"  {field or '(top level)'}: {msg}" for field, msg in found[:MAX_PROBLEMS]]
    if len(found) > MAX_PROBLEMS:
        lines.append(f"  ... and {len(found) - MAX_PROBLEMS} more")
    error = ConfigError(f"{len(found)} problems:\n" + "\n".join(lines), source=source)
    error.field = found[0][0] or None
    raise error


def load_model(model: type[M], path: str | Path) -> M:
    """Read and validate one file."""
    p = Path(path)
    return validate(model, read_document(p), str(p))
