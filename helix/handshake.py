"""The control plane's shared-secret handshake, both roles, as pure state machines (no sockets).

HELLO -> CHALLENGE -> AUTH -> WELCOME: the coordinator opens a control connection with HELLO and
its nonce; the agent answers CHALLENGE with its own nonce and its proof of the secret over both
(role ``"agent"``); the coordinator checks that proof and answers AUTH, its own proof over both
(role ``"coordinator"``); the agent checks it and answers WELCOME. Both sides prove the secret, and
no proof can be replayed (fresh nonces) or reflected (the role is inside the MAC,
:func:`helix.wire.prove`).

:class:`CoordinatorHandshake` (one per agent connection, used by :mod:`router.agents_io`) and
:class:`AgentHandshake` (one per coordinator connection, used by :mod:`node_agent.control`) take each
handshake message with ``on_message(msg)`` and return an :class:`Outcome`: the replies to send,
whether the peer is trusted now, or why it is not. Their callers own the sockets, the logs and the
timing (when to send HELLO again).

Retries are harmless: the coordinator sends the same HELLO (same nonce) until its agent answers,
the agent answers a repeated HELLO with the same CHALLENGE, and the coordinator answers each agent
nonce once; so the HELLOs queued while an agent was still starting complete one handshake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from helix import wire
from helix.errors import ProtocolError

AGENT_ROLE, COORDINATOR_ROLE = "agent", "coordinator"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one handshake message leads to: ``replies`` to send back (in order); ``trusted`` when the
    handshake completed with it; ``error`` when the peer failed it (why, in words for a log or a status)."""

    replies: tuple[wire.Message, ...] = ()
    trusted: bool = False
    error: str | None = None


class CoordinatorHandshake:
    """The coordinator's side of one control connection to agent ``node_id``."""

    def __init__(self, secret: bytes, name: str, node_id: str) -> None:
        self.secret, self.name, self.node_id = secret, name, node_id
        self.nonce = b""
        self._answered: bytes | None = None  # the agent nonce whose CHALLENGE proved the secret (AUTH sent)

    def start(self) -> wire.Hello:
        """A new connection: a fresh nonce, nothing proven yet; returns the HELLO to send."""
        self.nonce, self._answered = wire.make_nonce(), None
        return self.hello()

    def hello(self) -> wire.Hello:
        """The HELLO to send again (same nonce: a CHALLENGE to an earlier one still verifies)."""
        return wire.Hello(self.name, self.nonce)

    def on_message(self, msg: wire.Challenge | wire.Welcome | wire.Error) -> Outcome:
        if isinstance(msg, wire.Challenge):
            if not wire.verify(self.secret, msg.proof, AGENT_ROLE, self.nonce, msg.nonce):
                return Outcome(error="the agent did not prove the shared secret")
            if msg.node_id != self.node_id:
                return Outcome(error=f"expected node {self.node_id!r}, the agent is {msg.node_id!r}")
            if msg.nonce == self._answered:
                return Outcome()  # the same CHALLENGE to a repeated HELLO: answered already
            self._answered = msg.nonce
            return Outcome((wire.Auth(wire.prove(self.secret, COORDINATOR_ROLE, msg.nonce, self.nonce)),))
        if isinstance(msg, wire.Welcome):
            if self._answered is None:
                return Outcome(error="WELCOME before the agent proved the shared secret")
            if msg.node_id != self.node_id:
                return Outcome(error=f"expected node {self.node_id!r}, the agent welcomed as {msg.node_id!r}")
            return Outcome(trusted=True)
        if msg.code == "auth":
            self._answered = None
            return Outcome(error=f"the agent rejected our shared secret: {msg.reason}")
        return Outcome()  # another ERROR: not the handshake's business


class AgentHandshake:
    """The agent's side of one control connection; ``welcome`` makes the WELCOME (what the agent holds now)."""

    def __init__(self, secret: bytes, node_id: str, welcome: Callable[[], wire.Welcome]) -> None:
        self.secret, self.node_id, self.welcome = secret, node_id, welcome
        self.peer = ""  # the coordinator's name (its HELLO's sender)
        self._pending: tuple[bytes, bytes] | None = None  # (their nonce, ours) of the HELLO answered

    def on_message(self, msg: wire.Hello | wire.Auth) -> Outcome:
        """Raises :class:`~helix.errors.ProtocolError` for an AUTH with no HELLO before it."""
        if isinstance(msg, wire.Hello):
            if self._pending is None or self._pending[0] != msg.nonce:
                self._pending = (msg.nonce, wire.make_nonce())
            self.peer = msg.sender
            theirs, ours = self._pending
            return Outcome((wire.Challenge(self.node_id, ours, wire.prove(self.secret, AGENT_ROLE, theirs, ours)),))
        if self._pending is None:
            raise ProtocolError("AUTH without a pending HELLO")
        theirs, ours = self._pending
        self._pending = None
        if not wire.verify(self.secret, msg.proof, COORDINATOR_ROLE, ours, theirs):
            return Outcome((wire.Error("auth", "shared-secret proof rejected"),), error="wrong shared-secret proof")
        return Outcome((self.welcome(),), trusted=True)
