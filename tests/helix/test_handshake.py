"""The shared-secret handshake's two roles driven against each other, message by message (no sockets)."""

from __future__ import annotations

import pytest

from helix import wire
from helix.errors import ProtocolError
from helix.handshake import AgentHandshake, CoordinatorHandshake, Outcome

SECRET = b"handshake-secret"
WELCOME = wire.Welcome("a", 0, 16, 1000, "tcp://127.0.0.1:5555")


def agent(secret: bytes = SECRET, node_id: str = "a") -> AgentHandshake:
    return AgentHandshake(secret, node_id, lambda: WELCOME)


def only(outcome: Outcome) -> wire.Message:
    (reply,) = outcome.replies
    return reply


def test_both_sides_prove_the_secret_and_the_agent_welcomes() -> None:
    coordinator, side = CoordinatorHandshake(SECRET, "coordinator", "a"), agent()
    challenge = only(side.on_message(coordinator.start()))
    assert isinstance(challenge, wire.Challenge) and side.peer == "coordinator"
    auth = coordinator.on_message(challenge)
    assert isinstance(only(auth), wire.Auth) and auth.error is None and not auth.trusted
    welcomed = side.on_message(only(auth))  # type: ignore[arg-type]
    assert welcomed == Outcome((WELCOME,), trusted=True)
    assert coordinator.on_message(WELCOME) == Outcome(trusted=True)


def test_repeated_hellos_complete_one_handshake() -> None:
    """HELLOs queued while an agent starts: the same CHALLENGE to each, one AUTH, one WELCOME."""
    coordinator, side = CoordinatorHandshake(SECRET, "coordinator", "a"), agent()
    hellos = [coordinator.start(), coordinator.hello(), coordinator.hello()]
    challenges = [only(side.on_message(h)) for h in hellos]
    assert challenges[0] == challenges[1] == challenges[2]
    answers = [coordinator.on_message(c) for c in challenges]  # type: ignore[arg-type]
    assert [len(a.replies) for a in answers] == [1, 0, 0] and all(a.error is None for a in answers)
    assert side.on_message(only(answers[0])).trusted  # type: ignore[arg-type]


def test_an_agent_without_the_secret_or_with_another_node_id_is_not_trusted() -> None:
    coordinator = CoordinatorHandshake(SECRET, "coordinator", "a")
    wrong = coordinator.on_message(only(agent(b"other").on_message(coordinator.start())))  # type: ignore[arg-type]
    assert wrong == Outcome(error="the agent did not prove the shared secret")
    renamed = coordinator.on_message(only(agent(node_id="b").on_message(coordinator.start())))  # type: ignore[arg-type]
    assert renamed == Outcome(error="expected node 'a', the agent is 'b'")
    assert coordinator.on_message(WELCOME).error == "WELCOME before the agent proved the shared secret"


def test_a_coordinator_without_the_secret_is_refused() -> None:
    impostor, side = CoordinatorHandshake(b"guess", "impostor", "a"), agent()
    challenge = only(side.on_message(impostor.start()))
    assert isinstance(challenge, wire.Challenge)
    assert impostor.on_message(challenge).error == "the agent did not prove the shared secret"  # as it sees it
    refused = side.on_message(wire.Auth(wire.prove(b"guess", "coordinator", challenge.nonce, impostor.nonce)))
    assert refused.replies == (wire.Error("auth", "shared-secret proof rejected"),) and not refused.trusted
    assert refused.error == "wrong shared-secret proof"
    told = impostor.on_message(only(refused))  # type: ignore[arg-type]
    assert told.error == "the agent rejected our shared secret: shared-secret proof rejected"
    with pytest.raises(ProtocolError, match="AUTH without a pending HELLO"):  # that handshake is over
        side.on_message(wire.Auth(b"0" * 32))
