"""CURVE on the coordinator's sockets (the coordinator's half of :mod:`helix.keys`).

:class:`CoordinatorCurve` runs the ZAP authenticator of the coordinator's ZeroMQ context: its result
sink (the ``reply_to`` agents push TOKENS and REFUSED to) is a CURVE server that lets in only the
agents' keys, and a monitor logs every refused handshake (a peer without CURVE, with a wrong server
key, or with a key not in the cluster file). Each DEALER to an agent's control socket is a CURVE
client that expects that agent's own public key. The agents' side is ``node_agent.transport``
(the package table keeps the two apart; both follow :mod:`helix.keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import zmq

from helix.keys import HANDSHAKE_FAILED, HANDSHAKE_FAILED_AUTH, RESULTS, KeyGuard, KeyPair, handshake_failure


class CoordinatorCurve:
    """The coordinator's key pair, the agents' public keys (node -> Z85) and its ZAP authenticator."""

    def __init__(self, ctx: zmq.Context[Any], name: str, keys: KeyPair, agent_keys: Mapping[str, bytes]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.keys, self.agent_keys = keys, dict(agent_keys)
        self.guard = KeyGuard(name, {RESULTS: self.agent_keys}, self.agent_keys)
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        self.auth.start()  # before the sink binds: a CURVE server without a ZAP handler lets every key in
        self.auth.configure_curve_callback(RESULTS, self.guard)
        self.monitor: zmq.Socket[Any] | None = None

    def serve_results(self, sink: zmq.Socket[Any]) -> zmq.Socket[Any]:
        """Make the result sink (before it binds) a CURVE server for the agents; returns its monitor socket."""
        sink.curve_secretkey, sink.curve_publickey = self.keys.secret, self.keys.public
        sink.curve_server = True
        sink.zap_domain = RESULTS.encode()
        self.monitor = sink.get_monitor_socket(HANDSHAKE_FAILED)
        return self.monitor

    def dial(self, sock: zmq.Socket[Any], node_id: str) -> None:
        """Make ``sock`` (before it connects) a CURVE client of agent ``node_id``'s control socket."""
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_serverkey = self.agent_keys[node_id]

    def drain_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor is not None:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            why = handshake_failure(int(event["event"]), int(event["value"]))
            if why is not None and int(event["event"]) != HANDSHAKE_FAILED_AUTH:  # a refused key: KeyGuard logged it
                self.guard.refusals.refuse(RESULTS, why)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
        self.auth.stop()
