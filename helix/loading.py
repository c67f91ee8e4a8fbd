"""Reading YAML/JSON files into pydantic models with errors that name the file and field.

Every file format of Helix (cluster, profiles, plan) is loaded through :func:`load_model`,
so a typo, a missing field or a wrong type becomes a :class:`ConfigError` saying
``clusters/x.yaml: nodes[3].gpu: Field required`` instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from helix.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


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


def validate(model: type[M], data: Any, source: str) -> M:
    """Validate ``data`` as ``model``; the first error becomes a ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}", source=source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = format_loc(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        more = len(exc.errors()) - 1
        if more:
            msg += f" (and {more} more error{'s' if more > 1 else ''})"
        raise ConfigError(msg, source=source, field=field or None) from None


def load_model(model: type[M], path: str | Path) -> M:
    """Read and validate one file."""
    p = Path(path)
    return validate(model, read_document(p), str(p))
