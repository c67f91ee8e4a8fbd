"""Where the plan picture puts things: node positions, region boxes and GPU colours (pure, no drawing).

:func:`plan_layout` turns a cluster and a plan into a :class:`PlanLayout` in abstract *layout
units* (``planner.viz`` draws one unit as :data:`INCHES_PER_UNIT` inches, so distances here
are distances on paper):

* every region is a horizontal band (a :class:`RegionBox`), stacked top to bottom: the
  coordinator's region first, then the others in the order their first node appears in the
  cluster file; a node without a region is in ``(no region)``;
* inside a band, a node's x is the middle of the layer range it holds (layer 0 at x = 0, the
  last layer at ``axis_width``: 9 to :data:`MAX_LAYER_AXIS` units by cluster size), so the
  pipeline reads left to right; nodes whose x are closer than the room their labels need go to separate rows (interval packing; a few
  nodes still spread over :data:`MIN_ROWS` rows, neighbours zigzag so arrows miss nodes);
* nodes that hold no layers sit on extra rows at the bottom of their band, left to right;
* the coordinator is drawn twice, outside the bands: ``coordinator ▶`` on the left (token ids
  out) and ``▶ coordinator`` on the right (sampled tokens in), level with its region.

Guarantees (``tests/planner/test_viz.py``): two nodes are never closer than
:data:`MIN_DISTANCE`, every node lies inside its region's box, and boxes do not overlap.

:func:`gpu_color` is the fixed colour of a GPU type, the same in every picture: the table
:data:`GPU_COLORS` for common types (matched ignoring case, ``-``, ``_`` and spaces), and for any
other name a colour derived from a hash of the name (sha1: the same on every machine and run). Red is kept for the min cut and never used for a GPU.
"""

from __future__ import annotations

import colorsys
import hashlib
from dataclasses import dataclass

from helix.plan import Plan
from helix.spec import ClusterSpec

COORD_IN = "coordinator ▶"
COORD_OUT = "▶ coordinator"
NO_REGION = "(no region)"

INCHES_PER_UNIT = 0.6  # the drawing's scale
MIN_DISTANCE = 1.0  # no two nodes closer than this (units)
MAX_LAYER_AXIS = 16.0  # x of the model's last layer (units), from 9 for a few nodes to this
ROW_HEIGHT = 1.0  # between two rows of one band (>= MIN_DISTANCE)
HEADER = 1.05  # strip at the top of a band: the region's name and the top row's labels
PAD = 0.6  # box margin around its nodes
BAND_GAP = 0.5  # between two boxes
COORD_GAP = 1.8  # from a box's side to the coordinator
MIN_ROWS = 3  # a band with a few nodes still spreads them over this many rows
CHAR_WIDTH = 0.11  # a label character at the drawing's 6.5 pt font, digits and all (units)
NODE_RADIUS = 0.18  # a node's circle (units)
LABEL_LIFT = 0.24  # a node's name sits this far above its centre (units)
LABEL_HEIGHT = 0.22  # a line of label text with its padding (units)
EDGE_RAD = 0.12  # every arrow bends like matplotlib's ``arc3,rad=EDGE_RAD``
EDGE_LABEL_T = (0.5, 0.38, 0.62, 0.28, 0.72, 0.2, 0.8)  # where on an arrow its label may go, in order

GPU_COLORS: dict[str, str] = {  # keys as :func:`gpu_key` writes them
    "A100": "#1f77b4",  # blue (the paper's A100 is the 40 GB one)
    "A10040GB": "#1f77b4",
    "A10080GB": "#0b3d91",  # dark blue
    "H100": "#9467bd",  # purple
    "H100SXM": "#9467bd",
    "H200": "#5b2a86",  # dark purple
    "L4": "#2ca02c",  # green
    "L40S": "#bcbd22",  # olive
    "T4": "#ff7f0e",  # orange
    "V100": "#8c564b",  # brown
    "V10016GB": "#8c564b",
    "V10032GB": "#c49c94",  # light brown
    "A10": "#17becf",  # cyan
    "A10G": "#0e7c86",  # dark cyan
    "RTX4090": "#e377c2",  # pink
    "4090": "#e377c2",
    "CPU": "#7f7f7f",  # grey
}


def gpu_key(gpu: str) -> str:
    """A GPU name without case, ``-``, ``_`` or spaces: ``a100-80gb`` and ``A100_80GB`` are one type."""
    return gpu.upper().replace("-", "").replace("_", "").replace(" ", "")


def gpu_color(gpu: str) -> str:
    """The colour (``#rrggbb``) of GPU type ``gpu``, the same in every picture.

    :data:`GPU_COLORS` for the common types; any other name gets a hue from a hash of its
    :func:`gpu_key` (the same name, the same colour, on every machine), clear of red.
    """
    key = gpu_key(gpu)
    known = GPU_COLORS.get(key)
    if known is not None:
        return known
    digest = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
    hue = 0.08 + 0.84 * (digest % 1000) / 1000  # keep clear of red
    value = 0.55 + 0.3 * ((digest // 1000) % 2)
    r, g, b = colorsys.hsv_to_rgb(hue, 0.65, value)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


@dataclass(frozen=True, slots=True)
class RegionBox:
    """A region's band: its name and its box ``[x0, x1] × [y0, y1]`` (units, y grows upwards)."""

    name: str
    x0: float
    y0: float
    x1: float
    y1: float

    def contains(self, x: float, y: float) -> bool:
        return self.x0 <= x <= self.x1 and self.y0 <= y <= self.y1

    def overlaps(self, other: RegionBox) -> bool:
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1


@dataclass(slots=True)
class PlanLayout:
    """Positions of every node (and of :data:`COORD_IN` / :data:`COORD_OUT`), region boxes, colours."""

    positions: dict[str, tuple[float, float]]
    region_of: dict[str, str]  # node id -> region name (the coordinator's two ends are in none)
    regions: list[RegionBox]
    unused: list[str]  # nodes that hold no layers
    gpu_colors: dict[str, str]  # GPU type -> colour, for the types in this cluster
    num_layers: int
    axis_width: float  # x of the model's last layer

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)`` that holds everything drawn, labels included."""
        xs = [x for x, _ in self.positions.values()]
        ys = [y for _, y in self.positions.values()] + [b.y0 for b in self.regions] + [b.y1 for b in self.regions]
        return min(xs) - 1.2, min(ys) - 0.3, max(xs) + 1.2, max(ys) + 0.3

    def layer_x(self, layer: float) -> float:
        """The x of a layer boundary on the layer axis."""
        return layer / max(1, self.num_layers) * self.axis_width


def _region_order(cluster: ClusterSpec) -> list[str]:
    order: list[str] = []
    if cluster.coordinator.region is not None and any(n.region == cluster.coordinator.region for n in cluster.nodes):
        order.append(cluster.coordinator.region)
    for node in cluster.nodes:
        name = node.region if node.region is not None else NO_REGION
        if name not in order:
            order.append(name)
    return order


def _pack_rows(items: list[tuple[float, str]], gap: float, min_rows: int) -> list[list[tuple[float, str]]]:
    """Interval packing: each item (x, id), left to right, goes to a row whose last x is ``gap`` behind.

    There are as many rows as the tightest spot needs, and at least ``min_rows`` (so that a few
    nodes do not sit on one line with their arrows running through each other). An item takes the
    first row it fits in other than its left neighbour's, so neighbours zigzag between rows;
    any free row keeps the count minimal (items sorted by x form an interval graph).
    """
    order = sorted(items)
    needed = 0
    for i, (x, _) in enumerate(order):  # the most items within one gap: the fewest rows possible
        needed = max(needed, sum(1 for x2, _ in order[: i + 1] if x - x2 < gap - 1e-9))
    rows: list[list[tuple[float, str]]] = [[] for _ in range(max(needed, min(len(order), min_rows)))]
    last = -1
    for x, node in order:
        free = [r for r, row in enumerate(rows) if not row or x - row[-1][0] >= gap - 1e-9]
        last = min(free, key=lambda r: (r == last, r))
        rows[last].append((x, node))
    return [row for row in rows if row]


def plan_layout(cluster: ClusterSpec, plan: Plan, num_layers: int | None = None) -> PlanLayout:
    """Lay out ``plan`` on ``cluster`` (see the module docstring); ``num_layers``: the model's."""
    if num_layers is None:
        num_layers = max([e for _, e in plan.placement.values()], default=1)
    longest = max((len(n.id) for n in cluster.nodes), default=1)
    gap = max(1.6 * MIN_DISTANCE, CHAR_WIDTH * longest + 0.35)  # room for a label between row-mates
    width = min(MAX_LAYER_AXIS, max(9.0, 6.0 + 0.5 * len(cluster.nodes)))
    per_row = max(1, int(width // gap) + 1)
    region_of = {n.id: (n.region if n.region is not None else NO_REGION) for n in cluster.nodes}
    positions: dict[str, tuple[float, float]] = {}
    regions: list[RegionBox] = []
    unused: list[str] = []
    top = 0.0
    for region in _region_order(cluster):
        members = [n.id for n in cluster.nodes if region_of[n.id] == region]
        placed = [n for n in members if n in plan.placement]
        idle = [n for n in members if n not in plan.placement]
        unused.extend(idle)
        rows = _pack_rows([((s + e) / 2 / num_layers * width, n) for n in placed
                           for s, e in [plan.placement[n]]], gap, MIN_ROWS)  # fmt: skip
        rows += [[(i * gap, n) for i, n in enumerate(idle[k : k + per_row])] for k in range(0, len(idle), per_row)]
        for r, row in enumerate(rows):
            for x, node in row:
                positions[node] = (x, top - HEADER - r * ROW_HEIGHT)
        bottom = top - HEADER - (len(rows) - 1) * ROW_HEIGHT - PAD
        regions.append(RegionBox(region, -PAD, bottom, width + PAD, top))
        top = bottom - BAND_GAP
    coord_region = cluster.coordinator.region
    home = [b for b in regions if b.name == coord_region] or regions
    y_mid = (min(b.y0 for b in home) + max(b.y1 for b in home)) / 2 if home else 0.0
    positions[COORD_IN] = (-PAD - COORD_GAP, y_mid)
    positions[COORD_OUT] = (width + PAD + COORD_GAP, y_mid)
    colors = {g: gpu_color(g) for g in sorted({n.gpu for n in cluster.nodes})}
    return PlanLayout(positions, region_of, regions, unused, colors, num_layers, width)


Box = tuple[float, float, float, float]  # (x0, y0, x1, y1), units


def _meets(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def node_boxes(layout: PlanLayout) -> dict[str, list[Box]]:
    """What a node covers on paper: its circle's square and its name above it."""
    out: dict[str, list[Box]] = {}
    for name, (x, y) in layout.positions.items():
        half = CHAR_WIDTH * len(name) / 2 + 0.03
        out[name] = [(x - NODE_RADIUS, y - NODE_RADIUS, x + NODE_RADIUS, y + NODE_RADIUS),
                     (x - half, y + LABEL_LIFT, x + half, y + LABEL_LIFT + LABEL_HEIGHT)]  # fmt: skip
    return out


def arrow_point(a: tuple[float, float], b: tuple[float, float], t: float) -> tuple[float, float]:
    """The point at ``t`` along the arrow from ``a`` to ``b`` (the quadratic Bézier of ``arc3``)."""
    (x1, y1), (x2, y2) = a, b
    cx, cy = (x1 + x2) / 2 + EDGE_RAD * (y2 - y1), (y1 + y2) / 2 - EDGE_RAD * (x2 - x1)
    u = 1 - t
    return u * u * x1 + 2 * u * t * cx + t * t * x2, u * u * y1 + 2 * u * t * cy + t * t * y2


def edge_label_boxes(layout: PlanLayout, labels: dict[tuple[str, str], str]) -> dict[tuple[str, str], Box]:
    """Where each edge's label goes: the first point of :data:`EDGE_LABEL_T` along its arrow whose
    box meets no node, no node's name and no label placed before it (else the arrow's middle)."""
    taken = [box for boxes in node_boxes(layout).values() for box in boxes]
    out: dict[tuple[str, str], Box] = {}
    for (u, v), text in labels.items():
        half_w, half_h = CHAR_WIDTH * len(text) / 2 + 0.03, LABEL_HEIGHT / 2
        candidates = []
        for t in EDGE_LABEL_T:
            x, y = arrow_point(layout.positions[u], layout.positions[v], t)
            candidates.append((x - half_w, y - half_h, x + half_w, y + half_h))
        box = next((c for c in candidates if not any(_meets(c, o) for o in taken)), candidates[0])
        out[(u, v)] = box
        taken.append(box)
    return out
