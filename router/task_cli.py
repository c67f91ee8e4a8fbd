"""``helix tasks``: list, load or unload the fine-tuned tasks of a running coordinator (docs/pets.md).

A thin client of the coordinator's HTTP routes: ``GET /v1/models`` (the list),
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``. A refused load prints the
coordinator's error (it names the file and the tensor) and exits 1.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from helix.errors import ConfigError, HelixError


def add_tasks_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the coordinator's base URL")
    p.add_argument("--api-key", help="Bearer API key of the coordinator (default: $HELIX_API_KEY)")
    p.add_argument("--load", metavar="NAME=DIR", action="append", default=[],
                   help="load the task in directory DIR as NAME (DIR as every agent sees it; repeatable)")
    p.add_argument("--unload", metavar="NAME", action="append", default=[],
                   help="unload task NAME once its requests in flight finished (repeatable)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long one load or unload may take")


def run_tasks(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    key = args.api_key or os.environ.get("HELIX_API_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    loads = []
    for item in args.load:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise ConfigError(f"expected NAME=DIR, got {item!r}", field="--load")
        loads.append((name, str(Path(directory).expanduser().resolve())))
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout_s) as http:
        try:
            for name, directory in loads:
                _post(http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": directory}, console)
            for name in args.unload:
                _post(http, "/v1/unload_lora_adapter", {"lora_name": name}, console)
            if loads or args.unload:
                return 0
            models = _checked(http.get("/v1/models")).json()["data"]
        except httpx.HTTPError as exc:
            raise HelixError(f"cannot reach the coordinator at {args.url}: {exc}") from None
    table = Table(title=f"models at {args.url}")
    for column in ("model", "parent"):
        table.add_column(column)
    for card in models:
        table.add_row(card["id"], card.get("parent") or "(base model)")
    console.print(table)
    return 0


def _post(http: Any, path: str, body: dict[str, str], console: Any) -> None:
    console.print(_checked(http.post(path, json=body)).text, soft_wrap=True)


def _checked(response: Any) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except Exception:  # not an OpenAI-style body
            message = response.text
        raise HelixError(f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}")
    return response
