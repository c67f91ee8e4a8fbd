"""Addresses of the cluster's vertices: the one parser of ``tcp://HOST:PORT`` (ZeroMQ tcp endpoints).

The cluster file gives a node or the coordinator an ``address`` where it listens; a vertex without
one is on loopback (the local demo), so :func:`host_of` gives ``127.0.0.1`` for it. Everything
that needs the host of an address (keys' peer policy, the agent's bind checks, ``helix serve``'s
result sink, the profiler's local vertices, the simulator's shared hosts) asks here.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({LOOPBACK, "localhost", "::1"})
_PORT = re.compile(r":[^:\]]*$")  # the last ``:PORT`` of a netloc (not a colon inside ``[IPv6]``)


def host_of(address: str | None) -> str:
    """The host of a ZeroMQ tcp endpoint: ``tcp://10.0.0.7:5555`` -> ``10.0.0.7``, ``tcp://[::1]:*`` ->
    ``::1``; ``127.0.0.1`` for no address (a vertex without one is on loopback); "" when it names no host."""
    if not address:
        return LOOPBACK
    return urlsplit(address).hostname or ""


def any_port(address: str) -> str:
    """``address`` on any free port of the same host: ``tcp://10.0.0.7:5555`` -> ``tcp://10.0.0.7:*``."""
    parts = urlsplit(address)
    return f"{parts.scheme}://{_PORT.sub('', parts.netloc)}:*"
