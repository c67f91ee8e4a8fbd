"""The agent's side of live membership (issue 18): its layers change while it serves, and it leaves.

:class:`LayerChanges` (the engine thread's) answers SET_LAYERS and RELEASE_LAYERS:

* **SET_LAYERS(version, [c, d))**: a range past the model, an older version, or one that does not
  fit is answered at once by LAYERS with ``error``: memory is checked before anything loads
  (:func:`node_agent.memory.why_not_fit`: the new layers' weights, from the checkpoint's headers,
  plus the KV room they add, ``--kv-capacity-tokens`` x their layers, against the device's free
  memory and ``--max-weight-bytes``). Otherwise a loader thread reads and builds the missing
  layers (:mod:`node_agent.stage_layers`) while the engine keeps stepping; between two steps the
  engine thread inserts them (the engine then holds the union of old and new layers; ``[c, d)``
  is its range) and LAYERS (``op`` "load") tells the coordinator that asked. SET_LAYERS arriving
  during a load wait their turn, in order. Nothing is dropped.
* **RELEASE_LAYERS(version, drain_s)**: ``version`` must be the latest SET_LAYERS, loaded. The
  layers held outside its range are *moving*: a new request needing one is refused
  (:attr:`~helix.domain.ErrorCode.LAYERS_MOVED`, retryable); each is freed (weights, and the KV
  of the requests that ran it, which are gone) once no running request uses it; after ``drain_s``
  the requests still on them are refused the same way and the rest is freed. Then LAYERS
  (``op`` "release") answers. A SET_LAYERS during a release supersedes it (the release is
  answered with an error; nothing more is freed until the next RELEASE_LAYERS).

:class:`Drain` is the leaving agent's clock: after SIGTERM the agent refuses new requests
(:attr:`~helix.domain.ErrorCode.LEAVING`), tells its coordinators (LEAVING), finishes what it runs
within ``--drain-timeout-s`` (while a coordinator is connected to finish them) and refuses what is
left (:class:`node_agent.agent.NodeAgent` drives it).

:attr:`LayerChanges.welcome` is what the agent's WELCOME says about its layers (a snapshot the I/O
thread reads). Layer changes run on the torch backend only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helix import wire
from helix.domain import ErrorCode, LayerRange
from helix.errors import HelixError
from node_agent.memory import free_memory_bytes, why_not_fit
from node_agent.model import StageParts
from node_agent.routes import StageEngineLike
from node_agent.stage_layers import (
    LayerLoad,
    build_layers,
    describe_spans,
    kv_bytes_per_token_layer,
    load_nbytes,
    missing,
)

log = logging.getLogger(__name__)

Reply = Callable[[bytes | None, wire.Message], None]  # to the coordinator ``identity`` on the control socket
Refuse = Callable[[list[str], ErrorCode, str], None]  # refuse these requests (REFUSED to their coordinators)


@dataclass(frozen=True, slots=True)
class LayersView:
    """What the agent holds, for its WELCOME: its range, the version that gave it, every layer held."""

    layer_start: int
    layer_end: int
    version: int
    held: tuple[wire.LayerSpan, ...]


@dataclass(slots=True)
class _Load:
    identity: bytes | None
    msg: wire.SetLayers
    started: float
    thread: threading.Thread | None = None
    parts: StageParts | None = None
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Release:
    identity: bytes | None
    version: int
    keep: LayerRange
    deadline: float
    started: float


class LayerChanges:
    """SET_LAYERS and RELEASE_LAYERS on ``engine`` (engine thread; see the module doc)."""

    def __init__(self, node_id: str, engine: StageEngineLike, *, reply: Reply, refuse: Refuse, wake: Callable[[], None],
                 kv_capacity_tokens: int, max_weight_bytes: int | None = None,
                 threads: int | None = None) -> None:  # fmt: skip
        self.node_id, self.engine = node_id, engine
        self._reply, self._refuse, self._wake = reply, refuse, wake
        self.kv_capacity_tokens, self.max_weight_bytes = kv_capacity_tokens, max_weight_bytes
        self.threads = threads  # torch threads of the loader thread (None: torch's default)
        self.version = 0  # the latest version loaded
        self.given = 0  # the latest version asked for (loaded, loading or queued)
        self._ranges: dict[int, tuple[int, int]] = {}  # version -> its range (the versions asked for)
        self._load: _Load | None = None
        self._queued: deque[tuple[bytes | None, wire.SetLayers]] = deque()
        self._release: _Release | None = None
        self.moving: frozenset[int] = frozenset()  # layers being released: no new request may use them
        self.closed = ""  # why no layer changes are taken any more (the agent leaves)
        self.load_stalls: list[float] = []  # seconds each insert held the engine thread (between two steps)
        self.welcome = self._view()

    def refusal(self, start: int, end: int) -> str | None:
        """Why a new request on ``[start, end)`` is refused here (LAYERS_MOVED), or None."""
        if not self.moving.isdisjoint(range(start, end)):
            return f"layers [{start}, {end}) are being released here (plan version {self.version} moved them)"
        if not self.engine.holds(start, end):
            return f"this node does not hold layers [{start}, {end}) (it holds {describe_spans(self.engine.held)})"
        return None

    # -- SET_LAYERS -----------------------------------------------------------------------------

    def on_set(self, msg: wire.SetLayers, identity: bytes | None) -> None:
        error = self._check_set(msg)
        if error is not None:
            self._answer(identity, msg.version, "load", error)
            return
        if msg.version == self.given:  # the same SET_LAYERS again: answered now if loaded, else when it is
            if msg.version == self.version:
                self._answer(identity, msg.version, "load")
            return
        self.given = msg.version
        self._ranges[msg.version] = (msg.layer_start, msg.layer_end)
        if self._release is not None:
            release, self._release, self.moving = self._release, None, frozenset()
            self._answer(release.identity, release.version, "release",
                         f"superseded by SET_LAYERS version {msg.version}: nothing more is released")  # fmt: skip
        self._queued.append((identity, msg))
        if self._load is None:
            self._start_next()

    def _check_set(self, msg: wire.SetLayers) -> str | None:
        num_layers = self.engine.config.num_layers
        if self.closed:
            return self.closed
        if msg.layer_end > num_layers:
            return f"SET_LAYERS.layer_end: {msg.layer_end} is past the model's last layer (it has {num_layers} layers)"
        if msg.version < self.given:
            return f"SET_LAYERS.version: {msg.version} is older than version {self.given}, which this node was given"
        if msg.version == self.given and self._ranges.get(msg.version) != (msg.layer_start, msg.layer_end):
            start, end = self._ranges.get(msg.version, (self.engine.layer_start, self.engine.layer_end))
            return f"SET_LAYERS.version: version {msg.version} gave this node layers [{start}, {end}) already"
        try:
            self.engine.layer_model()
        except HelixError as exc:
            return exc.message
        return None

    def _start_next(self) -> None:
        while self._queued and self._load is None:
            identity, msg = self._queued.popleft()
            load = _Load(identity, msg, time.monotonic())
            need = missing(self.engine.layer_model(), msg.layer_start, msg.layer_end)
            error = self._why_not_fit(need) if need else None
            if error is not None:
                log.warning("SET_LAYERS version %d [%d, %d): %s", msg.version, msg.layer_start, msg.layer_end, error)
                self._failed(load, error)
            elif not need:  # held already: this range is the stage's from now on
                load.parts = StageParts({})
                self._loaded(load, time.monotonic())
            else:
                self._load = load
                load.thread = threading.Thread(target=self._build, args=(load, need), name="layer-loader", daemon=True)
                load.thread.start()

    def _loaded(self, load: _Load, now: float) -> None:
        msg = load.msg
        assert load.parts is not None
        t0 = time.perf_counter()
        self.engine.insert_layers(load.parts, msg.layer_start, msg.layer_end)
        if load.parts.layers:
            self.load_stalls.append(time.perf_counter() - t0)
        self.version = msg.version
        self._ranges = {v: r for v, r in self._ranges.items() if v >= msg.version}
        log.info("layers [%d, %d) of version %d loaded in %.2f s (held: %s)", msg.layer_start, msg.layer_end,
                 msg.version, now - load.started, describe_spans(self.engine.held))  # fmt: skip
        self._answer(load.identity, msg.version, "load", seconds=now - load.started)

    def _failed(self, load: _Load, error: str) -> None:
        """``load`` is not done: the stage stays as it was (the version may be asked for again)."""
        if self.given == load.msg.version:  # no later version queued behind it
            self.given = self.version
        self._ranges.pop(load.msg.version, None)
        self._answer(load.identity, load.msg.version, "load", error)

    def _why_not_fit(self, need: LayerLoad) -> str | None:
        model = self.engine.layer_model()
        try:
            weights = load_nbytes(model, self.engine.model_dir, need)
        except HelixError as exc:
            return exc.message
        kv = self.kv_capacity_tokens * kv_bytes_per_token_layer(model) * len(need.layers)
        return why_not_fit(weights=weights, kv=kv, free=free_memory_bytes(str(model.device)),
                           held=self.engine.weight_bytes, limit=self.max_weight_bytes)  # fmt: skip

    def _build(self, load: _Load, need: LayerLoad) -> None:  # the loader thread
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            load.parts = build_layers(self.engine.layer_model(), self.engine.model_dir, need)
        except HelixError as exc:
            load.error = exc.message
        except Exception as exc:  # noqa: BLE001 - a failed load is answered, the agent keeps serving
            log.exception("loading layers for SET_LAYERS version %d failed", load.msg.version)
            load.error = f"loading the layers failed: {exc}"
        load.done.set()
        self._wake()

    # -- RELEASE_LAYERS -------------------------------------------------------------------------

    def on_release(self, msg: wire.ReleaseLayers, identity: bytes | None) -> None:
        error = self.closed or None
        if error is None and msg.version != self.given:
            error = f"RELEASE_LAYERS.version: {msg.version} is not the latest version this node was given ({self.given})"
        elif error is None and (self._load is not None or self._queued or msg.version != self.version):
            error = f"RELEASE_LAYERS.version: version {msg.version} is still loading"
        if error is not None:
            self._answer(identity, msg.version, "release", error)
            return
        now = time.monotonic()
        keep = LayerRange(self.engine.layer_start, self.engine.layer_end)
        self._release = _Release(identity, msg.version, keep, now + msg.drain_s, now)
        self.moving = frozenset(i for r in self.engine.held for i in range(r.start, r.end) if i not in keep)
        self.poll(now)

    # -- between two steps ----------------------------------------------------------------------

    def poll(self, now: float) -> None:
        """Insert a finished load, and free released layers no request uses any more (engine thread)."""
        load = self._load
        if load is not None and load.done.is_set():
            self._load = None
            if load.error:
                self._failed(load, load.error)
            else:
                self._loaded(load, now)
            self._start_next()
        release = self._release
        if release is None:
            return
        self.engine.drop_layers(*release.keep)
        left = {i for r in self.engine.held for i in range(r.start, r.end)} - set(range(*release.keep))
        if left and now >= release.deadline:
            reason = (f"the layers it ran here were released (plan version {release.version} moved them) and its "
                      f"drain time is up")  # fmt: skip
            self._refuse(self.engine.requests_on(left), ErrorCode.LAYERS_MOVED, reason)
            self.engine.drop_layers(*release.keep)
            left = set()
        if not left:
            self._release, self.moving = None, frozenset()
            log.info("released the layers outside [%d, %d) (version %d; held: %s)", *release.keep, release.version,
                     describe_spans(self.engine.held))  # fmt: skip
            self._answer(release.identity, release.version, "release", seconds=now - release.started)

    def _answer(self, identity: bytes | None, version: int, op: str, error: str = "", seconds: float = 0.0) -> None:
        self.welcome = self._view()
        engine = self.engine
        self._reply(identity, wire.Layers(self.node_id, version, op, engine.layer_start, engine.layer_end,
                                          self.welcome.held, engine.weight_bytes, error, seconds))  # fmt: skip

    def _view(self) -> LayersView:
        held = tuple(wire.LayerSpan(r.start, r.end) for r in self.engine.held)
        return LayersView(self.engine.layer_start, self.engine.layer_end, self.version, held)


class Drain:
    """A leaving agent's drain: started once, up after ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self, now: float) -> None:
        self.deadline = now + self.timeout_s

    def up(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
