"""The cluster's nodes grouped by region, as the link-aware bounds read them (:mod:`planner.link_bound`,
:mod:`planner.region_zone`): interchangeable node classes, the best link between two groups, shared
uplinks, and the exact linearisation of "hop flow <= link x senders x receivers" those bounds share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from planner.capacity import CapacityModel
from planner.solvers import Model

NO_REGION = "\x00no-region"


@dataclass(slots=True, frozen=True)
class NodeClass:
    """Interchangeable nodes at a boundary: one group (region), one kind, one NIC."""

    group: str
    kind: str
    nic_tok_s: float  # inf: no NIC cap
    count: int


@dataclass(slots=True, frozen=True)
class Groups:
    """The cluster's node groups (regions) as the bound reads them."""

    names: list[str]
    size: dict[str, int]
    classes: list[NodeClass]
    link: dict[tuple[str, str], float]  # (r, s) -> best activation tok/s of a node pair r -> s (0: none)
    uplink: dict[str, float]  # real regions with a shared uplink (tok/s)
    downlink: dict[str, float]
    any_ungrouped: bool

    @classmethod
    def of(cls, cap: CapacityModel) -> Groups:
        group = {n: cap.region_of[n] or NO_REGION for n in cap.nodes}
        names = list(dict.fromkeys(group[n] for n in cap.nodes))
        counts: dict[tuple[str, str, float], int] = {}
        for n in cap.nodes:
            key = (group[n], cap.kind_of[n], cap.node_nic_tok_s(n) or math.inf)
            counts[key] = counts.get(key, 0) + 1
        link: dict[tuple[str, str], float] = {(r, s): 0.0 for r in names for s in names}
        members = set(cap.nodes)
        for (a, b), _ in cap.links.items():
            if a in members and b in members:
                c = cap.activation_link_tok_s(a, b) or 0.0
                key2 = (group[a], group[b])
                link[key2] = max(link[key2], c)
        up = {r: v for r in names if r != NO_REGION and (v := cap.region_uplink_tok_s(r)) is not None}
        down = {r: v for r in names if r != NO_REGION and (v := cap.region_downlink_tok_s(r)) is not None}
        return cls(names=names, size={r: sum(1 for n in cap.nodes if group[n] == r) for r in names},
                   classes=[NodeClass(g, k, nic, c) for (g, k, nic), c in counts.items()], link=link,
                   uplink=up, downlink=down, any_ungrouped=NO_REGION in names)

    def nodes_of(self, cap: CapacityModel, subset: frozenset[str]) -> list[str]:
        return [n for n in cap.nodes if (cap.region_of[n] or NO_REGION) in subset]

    def proper_subsets(self) -> list[frozenset[str]]:
        return [frozenset(c) for size in range(1, len(self.names)) for c in combinations(self.names, size)]

    def shares_uplink(self, src: str, dst: str) -> bool:
        """Whether a hop src -> dst between different real regions uses src's uplink and dst's downlink."""
        return src != dst and NO_REGION not in (src, dst)

    def receivers_needed(self, dst: str, flow: float) -> int:
        """How many receivers of group ``dst`` a pair count must distinguish: beyond this many, one sender's
        links from some group carry ``flow`` alone (0: no group reaches ``dst``)."""
        reach = [self.link[(r, dst)] for r in self.names if self.link[(r, dst)] > 0]
        return min(self.size[dst], max((math.ceil(flow / a) for a in reach), default=0))


def unary_count(m: Model, idx: list[int], q_cap: int) -> list[int]:
    """Binaries beta_1..beta_q_cap with sum <= 1 and sum q beta_q <= sum of the columns ``idx`` (a node
    count): setting beta at min(count, q_cap) satisfies them, so they relax the count exactly up to q_cap."""
    beta = [m.add_col(0, 1, integer=True) for _ in range(q_cap)]
    m.add_row(beta, [1.0] * q_cap, hi=1.0)
    m.add_row(beta + idx, [float(q + 1) for q in range(q_cap)] + [-1.0] * len(idx), hi=0.0)
    return beta


def cap_by_pairs(m: Model, hop: int, link: float, beta: list[int], senders: list[int], max_senders: int) -> None:
    """hop <= link x (sum of the columns ``senders``) x (the count ``beta`` stands for), exactly linearised:
    w_q = senders x beta_q (w_q <= senders, w_q <= max_senders beta_q) and hop <= link sum_q q w_q."""
    w = [m.add_col(0, max_senders) for _ in beta]
    for p, b in enumerate(beta):
        m.add_row([w[p]] + senders, [1.0] + [-1.0] * len(senders), hi=0.0)
        m.add_row([w[p], b], [1.0, -float(max_senders)], hi=0.0)
    m.add_row([hop] + w, [1.0] + [-link * (q + 1) for q in range(len(beta))], hi=0.0)
