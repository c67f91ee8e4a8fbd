"""Rich output shared by every command: tables whose cells are never cut.

A rich table wider than the console shrinks its columns and cuts cells with "…" — at 80
columns (a CI log, ``COLUMNS=80``) that cut node names and numbers.
:func:`print_table` gives every value column (right-aligned: numbers, ranges, ratios) at
least the width of its widest cell. On a terminal, text columns (names) fold onto more lines
where space is short; elsewhere (a log, a pipe) the table is printed as wide as it takes to
show every cell whole on one line. Lines are never cropped: a table that still does not fit
runs past the edge (the terminal wraps it) rather than losing digits.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

WIDE = 10_000  # "unlimited" width for measuring


def _cell_width(console: Console, cell: Any) -> int:
    if isinstance(cell, str):
        cell = Text.from_markup(cell)
    return Measurement.get(console, console.options.update_width(WIDE), cell).maximum


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every value cell whole (and, off a terminal, every cell)."""
    for col in table.columns:
        if col.justify == "right" or not console.is_terminal:
            widths = [_cell_width(console, c) for c in col._cells]
            if widths:
                col.min_width = max([col.min_width or 0, *widths])
        else:
            col.overflow = "fold"
    width = console.width
    if not console.is_terminal:
        width = max(width, Measurement.get(console, console.options.update_width(WIDE), table).minimum)
    console.print(table, width=width, crop=False)
