"""Rich output for the CLI commands: tables whose cells are never cut.

A rich table wider than the console shrinks its columns and cuts cells with "…" — at 80
columns (a CI log, ``COLUMNS=80``) that cut the planner's and the simulator's numbers.
:func:`print_table` gives every column at least the width of its widest cell (headers may
wrap) and prints the table at the console's width or, when that is what it takes to show
every cell whole, wider (the terminal then wraps the long lines; nothing is cut).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def _cell_width(console: Console, cell: Any) -> int:
    if isinstance(cell, str):
        cell = Text.from_markup(cell)
    return Measurement.get(console, console.options.update_width(10_000), cell).maximum


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every cell whole (wider than the console if need be)."""
    for col in table.columns:
        widths = [_cell_width(console, c) for c in col._cells]
        if widths:
            col.min_width = max([col.min_width or 0, *widths])
    need = Measurement.get(console, console.options.update_width(10_000), table).minimum
    console.print(table, width=max(console.width, need), crop=False)
