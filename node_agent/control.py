"""The agent's control plane: its coordinators, and its answers to LOAD_TASK / UNLOAD_TASK.

:class:`Coordinators` (the I/O thread's) runs the shared-secret handshake with each coordinator
connection on the control socket (:class:`helix.handshake.AgentHandshake`: HELLO -> CHALLENGE ->
AUTH -> WELCOME), remembers who is authenticated, sends to them (a peer that is gone is forgotten)
and builds the HEARTBEAT from the engine thread's snapshots. :func:`task_status` (the engine
thread's, between two steps) loads or unloads a fine-tuned task on the stage and says how it went:
the TASK_STATUS to the coordinator that asked.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from helix import wire
from helix.errors import HelixError, PETError
from helix.handshake import AgentHandshake

if TYPE_CHECKING:
    from node_agent.routes import StageEngineLike

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 1024


class Coordinators:
    """The coordinators on the agent's control socket: their handshakes and the authenticated ones (I/O thread)."""

    def __init__(self, control: zmq.Socket[Any], secret: bytes, node_id: str,
                 welcome: Callable[[], wire.Welcome]) -> None:  # fmt: skip
        self._control, self._secret, self._node_id, self._welcome = control, secret, node_id, welcome
        self._handshakes: OrderedDict[bytes, AgentHandshake] = OrderedDict()  # identity -> its handshake so far
        self._trusted: dict[bytes, str] = {}  # authenticated identity -> coordinator name
        self._hb_seq = 0

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._trusted

    @property
    def connected(self) -> bool:
        """Whether any authenticated coordinator is still there (any thread may ask)."""
        return bool(self._trusted)

    def handshake(self, identity: bytes, msg: wire.Hello | wire.Auth) -> None:
        # an AUTH ends the handshake, either way; a HELLO starts one (a repeated HELLO continues it)
        handshake = self._handshakes.pop(identity, None) or AgentHandshake(self._secret, self._node_id, self._welcome)
        if isinstance(msg, wire.Hello):
            self._trusted.pop(identity, None)
            self._handshakes[identity] = handshake  # the latest MAX_HANDSHAKES pending ones are kept
            while len(self._handshakes) > MAX_HANDSHAKES:
                self._handshakes.popitem(last=False)
        outcome = handshake.on_message(msg)
        for reply in outcome.replies:
            self.send(identity, reply)
        if outcome.error is not None:
            log.warning("rejected coordinator %r: %s", handshake.peer, outcome.error)
        elif outcome.trusted:
            self._trusted[identity] = handshake.peer
            log.info("coordinator %s authenticated", handshake.peer)

    def send(self, identity: bytes, msg: wire.Message) -> bool:
        try:
            self._control.send_multipart([identity, *wire.encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except (zmq.Again, zmq.ZMQError):  # peer gone (ROUTER_MANDATORY) or full
            self._trusted.pop(identity, None)
            return False

    def send_to(self, identity: bytes | None, msg: wire.Message) -> None:
        """Send ``msg`` to the coordinator ``identity`` (None: to every authenticated one)."""
        for to in list(self._trusted) if identity is None else [identity]:
            self.send(to, msg)

    def heartbeat(self, usage: Any, queues: tuple[int, int], steps: wire.StepStats) -> None:
        """A HEARTBEAT to every authenticated coordinator: KV ``usage`` (a KVUsage), (waiting, running), step stats."""
        if not self._trusted:
            return
        waiting, running = queues
        self._hb_seq += 1
        hb = wire.Heartbeat(self._node_id, self._hb_seq, usage.used_tokens, usage.reserved_tokens,
                            usage.capacity_tokens, waiting, running, steps)
        self.send_to(None, hb)


def task_status(node_id: str, engine: StageEngineLike, msg: wire.LoadTask | wire.UnloadTask) -> wire.TaskStatus:
    """Load (the stage's layers of the task directory ``msg.path``) or unload a fine-tuned task on ``engine``,
    then give the memory this freed back to the system (:func:`release_free_memory`)."""
    try:
        return _load_or_unload(node_id, engine, msg)
    finally:
        release_free_memory()


def release_free_memory() -> None:
    """Return the C allocator's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Reading and binding a task frees its files' tensors and the temporaries of binding between the
    allocations the agent keeps; glibc keeps such holes: without this an agent's RSS grew ~1.2x the
    bytes its tasks hold (bench/pets.py (a)), and an unloaded task's memory could stay with the process. It
    costs about a millisecond (tens at most) per load or unload.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (AttributeError, OSError):  # not glibc
        return None


def _load_or_unload(node_id: str, engine: StageEngineLike, msg: wire.LoadTask | wire.UnloadTask) -> wire.TaskStatus:
    if isinstance(msg, wire.UnloadTask):
        engine.remove_task(msg.task_id)
        log.info("task %s unloaded", msg.task_id)
        return wire.TaskStatus(node_id, msg.task_id, "unload", True)
    from node_agent.task_files import in_file, load_task_slice

    try:
        descriptor, pet = load_task_slice(msg.path, engine.config, engine.layer_start, engine.layer_end)
        with in_file(str(descriptor.weights)):
            bound = engine.add_task(msg.task_id, pet, max_lora_rank=msg.max_lora_rank or None)
    except PETError as exc:
        log.warning("task %s not loaded: %s", msg.task_id, exc.message)
        return wire.TaskStatus(node_id, msg.task_id, "load", False, exc.message)
    except HelixError as exc:  # e.g. a backend that runs no tasks
        return wire.TaskStatus(node_id, msg.task_id, "load", False, exc.message)
    log.info("task %s loaded (%s, %d bytes for layers [%d, %d))", msg.task_id, pet.pet_type, bound.nbytes,
             engine.layer_start, engine.layer_end)  # fmt: skip
    return wire.TaskStatus(node_id, msg.task_id, "load", True, nbytes=int(bound.nbytes))
