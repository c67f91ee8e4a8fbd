"""What the coordinator core hears from the cluster (:meth:`router.core.CoordinatorCore.update_from_output`)
and what the transport (:class:`router.agents_io.AgentsIO`) reports about each agent.

Besides the agents' own messages (``wire.Tokens`` from last stages, ``wire.Refused`` from any
stage; on the control socket ``wire.Layers``, how a SET_LAYERS / RELEASE_LAYERS went, and
``wire.Leaving``, the agent drains before it stops), the transport turns what it observes into
events: an agent completed the handshake (:class:`AgentJoined`), its heartbeats stopped
(:class:`AgentDied`; :class:`AgentLeft` when it had said LEAVING: a departure, not a crash), a
message to it could not be sent (:class:`Unreachable`), and the shell folds the agents' KV
heartbeats in (:class:`KVReported`).
"""

from __future__ import annotations

from dataclasses import dataclass

from helix import wire
from helix.wire import StepStats


@dataclass(frozen=True, slots=True)
class AgentJoined:
    """``node``'s agent completed the handshake; ``welcome`` says what it holds and where its data plane is."""

    node: str
    welcome: wire.Welcome


@dataclass(frozen=True, slots=True)
class AgentDied:
    """``node``'s heartbeats stopped (or it could not be reached): route around it."""

    node: str


@dataclass(frozen=True, slots=True)
class AgentLeft:
    """``node``'s agent said LEAVING, drained and stopped (its heartbeats stopped after LEAVING)."""

    node: str


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A message of attempt ``wire_id`` could not be sent to ``node`` (not connected, or not taking messages)."""

    node: str
    wire_id: str


@dataclass(frozen=True, slots=True)
class KVReported:
    """``node``'s KV use in entries (tokens x its layers), from its latest heartbeat."""

    node: str
    used: float
    reserved: float
    capacity: float


AgentEvent = (wire.Tokens | wire.Refused | wire.Layers | wire.Leaving | AgentJoined | AgentDied | AgentLeft | Unreachable
              | KVReported)


@dataclass(frozen=True, slots=True)
class KVReport:
    """The latest heartbeat of an agent: KV tokens, queue lengths (``waiting`` for admission to
    its scheduler, ``running`` in it), its engine steps so far, and how old it is."""

    node_id: str
    used_tokens: int
    reserved_tokens: int
    capacity_tokens: int
    waiting: int
    running: int
    age_s: float
    steps: StepStats = StepStats()
