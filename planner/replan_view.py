"""What ``helix plan --from`` prints about a re-plan: the moves node by node and the decision.

:func:`print_moves` draws one row per node whose range changes (or that joins or leaves): its GPU,
its range before and after, the layers it keeps, loads and drops; then the totals, the from-scratch
plan's moves and the proven fewest (``planner.min_moves``) beside them, the two plans' objective and
which one was chosen and why. The plan's own table follows it (``planner.commands.print_plan``).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from helix.console import print_table
from helix.domain import LayerRange
from planner.moves import NodeMove
from planner.replan import Replan


def _ranges(rs: list[LayerRange]) -> str:
    return ", ".join(r.describe() for r in rs) if rs else "—"


def _one(r: LayerRange | None) -> str:
    return r.describe() if r is not None else "—"


def moves_table(r: Replan, gpu: dict[str, str]) -> Table:
    """The nodes that change, in layer order of their new range (leavers last)."""
    changed = [m for m in r.moves if m.change != "kept"]

    def order(m: NodeMove) -> tuple[int, int, str]:
        return (m.after.start if m.after is not None else 10**9, m.after.end if m.after is not None else 0, m.node)

    table = Table(title=f"moves: {r.layers_moved} layers to load on {sum(m.loaded > 0 for m in changed)} node(s)")
    for col in ("node", "GPU", "change", "before", "after", "kept", "load", "drop", "# load"):
        table.add_column(col, justify="right" if col == "# load" else "left")
    for m in sorted(changed, key=order):
        table.add_row(m.node, gpu.get(m.node, "—"), m.change, _one(m.before), _one(m.after), _one(m.kept),
                      _ranges(m.load), _ranges(m.drop), str(m.loaded), style="dim" if m.change == "leaves" else "")
    return table


def print_moves(console: Console, r: Replan, gpu: dict[str, str]) -> None:
    """The moves table, what changed in the membership, and the decision."""
    who = [f"left: {', '.join(r.removed)}" if r.removed else "", f"joined: {', '.join(r.added)}" if r.added else ""]
    console.print("membership: " + ("; ".join(w for w in who if w) or "unchanged"))
    kept = sum(1 for m in r.moves if m.change == "kept")
    if any(m.change != "kept" for m in r.moves):
        print_table(console, moves_table(r, gpu))
    console.print(f"{kept} node(s) keep their layers")
    line = f"[bold]{r.decision}[/] plan: {r.layers_moved} layers to load ({r.bytes_moved / 1e9:.1f} GB of weights)"
    if r.scratch_layers_moved is not None:
        line += f" (from scratch: {r.scratch_layers_moved}, relabelled to keep layers in place)"
    if r.fewest is not None and (r.fewest.status == "optimal" or r.fewest.lower_bound > 0):
        proven = "" if r.fewest.status == "optimal" else "at least "
        line += f"; fewest possible above the fallback floor: {proven}{r.fewest.lower_bound}"
    console.print(line)
    values = ", ".join(f"{k} {v:.1f}" for k, v in r.values.items())
    console.print(f"objective ({r.plan.objective}): {values}; {r.reason}; re-planned in {r.wall_s:.1f} s")
