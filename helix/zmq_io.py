"""ZeroMQ plumbing shared by the node agent and the coordinator's transport: one I/O-loop skeleton
(:class:`IOLoop`) and CURVE on sockets (:class:`CurveSockets`).

The one module of ``helix`` that imports zmq (tests/test_dependencies.py names it): node_agent may
import only helix and router may not import node_agent, so the code both run lives here. ``import
helix`` does not load it; :mod:`node_agent.agent` and :mod:`router.agents_io` do.

An :class:`IOLoop` belongs to one thread, which calls :meth:`IOLoop.run`: each turn it polls its
sockets (up to the next tick), hands each readable socket's messages to its handler, runs the
callables other threads queued with :meth:`IOLoop.call` (they wake the poll through a socket pair),
and calls ``on_tick`` every ``tick_s``. Everything but :meth:`~IOLoop.call`, :meth:`~IOLoop.wake` and
:meth:`~IOLoop.stop` runs on that thread.

:class:`CurveSockets` runs a process's ZAP authenticator, asking a :class:`helix.keys.KeyGuard` which
keys each plane (ZAP domain) lets in; it makes bound sockets CURVE servers of one plane each (the
refused handshakes that never reach ZAP are read from a socket monitor and logged) and outgoing
sockets CURVE clients of the one server key they expect.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from helix.keys import HANDSHAKE_FAILED, HANDSHAKE_FAILED_AUTH, KeyGuard, KeyPair, handshake_failure

MAX_DRAIN = 256  # messages taken from one socket per turn (the other sockets and the ticks keep their turn)

Frames = list[zmq.Frame]


class IOLoop:
    """One thread's ZeroMQ loop (see the module doc); ``after_turn`` runs at the end of every turn."""

    def __init__(self, *, tick_s: float, on_tick: Callable[[], None] | None = None,
                 after_turn: Callable[[], None] | None = None, max_drain: int = MAX_DRAIN) -> None:  # fmt: skip
        self.tick_s, self.on_tick, self.after_turn, self.max_drain = tick_s, on_tick, after_turn, max_drain
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[], None]] = {}
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._stop = threading.Event()

    # -- any thread ------------------------------------------------------------------------------

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread, after what was queued before it."""
        self._inbox.append(fn)
        self.wake()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def stop(self) -> None:
        """End :meth:`run` after the current turn."""
        self._stop.set()
        self.wake()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- the loop's thread -----------------------------------------------------------------------

    def watch(self, sock: zmq.Socket[Any], on_message: Callable[[Frames], None]) -> None:
        """Hand each message arriving on ``sock`` (its frames, not copied) to ``on_message``."""
        self.watch_ready(sock, functools.partial(self._drain, sock, on_message))

    def watch_ready(self, sock: zmq.Socket[Any], on_ready: Callable[[], None]) -> None:
        """Call ``on_ready`` whenever ``sock`` has something to read (it reads it)."""
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = on_ready

    def unwatch(self, sock: zmq.Socket[Any]) -> None:
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def run_pending(self) -> None:
        """Run the queued callables now (e.g. before sending something that must follow them)."""
        while self._inbox:
            self._inbox.popleft()()

    def run(self) -> None:
        """Turn until :meth:`stop`."""
        next_tick = time.monotonic()
        while not self._stop.is_set():
            wait_ms = max(0, math.ceil((next_tick - time.monotonic()) * 1000))
            for item, _ in self._poller.poll(wait_ms):
                handler = self._handlers.get(item)  # None: the wake-up pipe, or a socket unwatched this turn
                if handler is not None:
                    handler()
            try:
                while self._wake_r.recv(4096):
                    pass
            except OSError:  # drained
                pass
            self.run_pending()
            if self.after_turn is not None:
                self.after_turn()
            now = time.monotonic()
            if now >= next_tick:
                if self.on_tick is not None:
                    self.on_tick()
                next_tick = now + self.tick_s

    def close(self) -> None:
        """Close the wake-up pair (the sockets watched are their owners' to close)."""
        self._wake_r.close()
        self._wake_w.close()

    def _drain(self, sock: zmq.Socket[Any], on_message: Callable[[Frames], None]) -> None:
        for _ in range(self.max_drain):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            on_message(frames)


class CurveSockets:
    """CURVE on one process's sockets: a ZAP authenticator asking ``guard`` which keys each plane lets in, bound
    sockets made CURVE servers of one plane each (with a monitor whose failed handshakes are logged), and
    outgoing sockets made CURVE clients of the peer they dial."""

    def __init__(self, ctx: zmq.Context[Any], keys: KeyPair, guard: KeyGuard) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.keys, self.guard = keys, guard
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        self.auth.start()  # before any bind: a CURVE server without a ZAP handler would let every key in
        for plane in guard.domains:
            self.auth.configure_curve_callback(plane, guard)
        self.monitors: dict[zmq.Socket[Any], str] = {}  # monitor socket -> its plane

    def serve(self, sock: zmq.Socket[Any], plane: str) -> None:
        """Make ``sock`` (before it binds) a CURVE server of ``plane``, with a monitor (:meth:`watch` reads it)."""
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_server = True
        sock.zap_domain = plane.encode()
        self.monitors[sock.get_monitor_socket(HANDSHAKE_FAILED)] = plane

    def dial(self, sock: zmq.Socket[Any], server_key: bytes) -> None:
        """Make ``sock`` (before it connects) a CURVE client that talks only to the holder of ``server_key``."""
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_serverkey = server_key

    def watch(self, loop: IOLoop) -> None:
        """Log the failed handshakes of every socket served so far, from ``loop``'s thread."""
        for monitor in self.monitors:
            loop.watch_ready(monitor, functools.partial(self._drain_monitor, monitor))

    def _drain_monitor(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        plane = self.monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            why = handshake_failure(int(event["event"]), int(event["value"]))
            if why is not None and int(event["event"]) != HANDSHAKE_FAILED_AUTH:  # a refused key: KeyGuard logged it
                self.guard.refusals.refuse(plane, why)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.monitors.clear()
        self.auth.stop()
