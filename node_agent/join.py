"""A joining agent's ask to its coordinator (``helix agent --join URL``, issue 18).

Once the agent is up, holding no layers, :class:`JoinRequest` POSTs ``URL/v1/cluster/join`` with
the node's id, GPU type, region and control address (``Authorization: Bearer`` the API key from
the environment variable ``--api-key-env`` names, when set). The coordinator then dials the control
address; the shared-secret handshake authenticates the two as for any agent, and the coordinator's
re-plan gives the node its layers with SET_LAYERS. A coordinator not up yet is asked again every
second for ``timeout_s``; a refusal (4xx: a taken id, an unknown GPU type, a bad key) is logged
with the coordinator's message and not repeated.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

RETRY_S = 1.0


class JoinRequest:
    """Asks the coordinator at ``url`` to take this node in (see the module doc)."""

    def __init__(self, url: str, node_id: str, gpu: str, *, region: str | None = None, api_key: str = "",
                 timeout_s: float = 120.0) -> None:  # fmt: skip
        self.url = url.rstrip("/").removesuffix("/v1") + "/v1/cluster/join"
        self.node_id, self.gpu, self.region, self.api_key, self.timeout_s = node_id, gpu, region, api_key, timeout_s
        self.accepted = threading.Event()

    def start(self, control_address: str) -> threading.Thread:
        """Ask from a background thread (the agent serves meanwhile)."""
        thread = threading.Thread(target=self.send, args=(control_address,), name="join", daemon=True)
        thread.start()
        return thread

    def send(self, control_address: str) -> bool:
        """Ask until the coordinator answers; True when it accepted."""
        body = json.dumps({"node_id": self.node_id, "gpu": self.gpu, "control_address": control_address,
                           "region": self.region}).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        deadline = time.monotonic() + self.timeout_s
        while True:
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    log.info("coordinator %s accepted node %s (HTTP %d): it dials %s", self.url, self.node_id,
                             response.status, control_address)  # fmt: skip
                    self.accepted.set()
                    return True
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    log.error("coordinator %s refused node %s: HTTP %d %s", self.url, self.node_id, exc.code,
                              _message(exc.read()))  # fmt: skip
                    return False
                why = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                why = str(getattr(exc, "reason", exc))
            if time.monotonic() > deadline:
                log.error("coordinator %s did not take node %s within %.0f s (%s)", self.url, self.node_id,
                          self.timeout_s, why)  # fmt: skip
                return False
            time.sleep(RETRY_S)


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500]
