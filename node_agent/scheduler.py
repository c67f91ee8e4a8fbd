"""The per-agent iteration-level scheduler: a pure, step-driven policy (no tensors, no I/O).

Each step (``schedule()`` -> run -> ``update(batch, finished)``):

* **Admission (Orca).** Waiting requests are admitted strictly FCFS while the running set is below
  ``max_batch_size`` and the KV account can *reserve* ``prompt + max_tokens`` tokens for them.
  Because the worst case is reserved up front, every running request can always finish, so the
  scheduler never deadlocks; a request larger than the whole KV capacity is refused at ``add``.
* **Decodes first.** Every running request in its decode phase that has an input token gets one
  token in the step (at most ``max_batch_size`` tokens, which the budget always covers).
* **Chunked prefill (Sarathi, ``chunk_size`` set): decode-maximal batching.** Then prefill chunks
  of the running prompts, FCFS, carry at most ``chunk_size`` prompt tokens in all (and no more than
  the remaining ``token_budget``): the oldest prompt's next chunk first, and where it ends before
  the chunk is full, the next prompt's first tokens (Sarathi-Serve's stall-free batching; vLLM
  packs its steps the same way). ``chunk_size`` thus bounds the prefill work a step adds to the
  running decodes' time between tokens, however short the prompts are.
* **Unchunked prefill (Orca, ``chunk_size=None``): several whole prompts per step.** Then the
  running requests in prefill, FCFS, each with its whole pending prompt, as long as it fits the
  remaining ``token_budget``; the oldest one always runs even if it alone exceeds the budget (a
  prompt longer than the budget must still make progress). Like Orca's Algorithm 1 the batch is
  bounded by ``max_batch_size`` and the KV reservation; the budget caps one step's tokens (set it
  to ``max_batch_size`` x the longest prompt to make it non-binding, as in Orca).
* ``request_level=True`` is the pre-Orca baseline (FasterTransformer-style): new requests join
  only when the running set is empty, so a batch runs until its last request finishes; with
  unchunked prefill its prompts are prefilled together (as far as the budget allows), then decoded
  together.

A request is schedulable only when it has *pending input*: prompt tokens on the stage that embeds,
hidden states pushed from the previous stage, or the token sampled in the previous step.

**Many tasks** (``SchedulerConfig.batching``, :mod:`node_agent.batching`): the default, ``fcfs``, is all
of the above. The other modes (PetS's coordinated batching and its α-only and β-only baselines) choose
the admission order by the requests' tasks and the node's cost models, β-only also which ready
requests a step runs, and every one of them bounds how many steps a request can be passed over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter

from helix.errors import EngineError
from node_agent.batching import FCFS, BatchingMode, BatchingPolicy, admission_order, beta_only_ready
from node_agent.kv_account import KVAccount, KVUsage


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 32
    token_budget: int = 512
    chunk_size: int | None = 256
    request_level: bool = False
    batching: BatchingPolicy = FCFS

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.token_budget < self.max_batch_size:
            raise EngineError(f"token_budget ({self.token_budget}) must be >= max_batch_size ({self.max_batch_size})")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise EngineError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")


@dataclass(slots=True)
class SequenceState:
    """The scheduler's view of one request on this stage."""

    request_id: str
    prompt_tokens: int
    reserve_tokens: int
    computed_tokens: int = 0  # tokens whose KV this stage holds
    pending_tokens: int = 0  # inputs arrived but not yet run
    order: int = 0  # when it was admitted, among this stage's admissions (running requests are served in it)
    task: str | None = None  # the fine-tuned task it runs (None: the base model) ...
    pet_type: str | None = None  # ... and its PET type (what the batching policy prices)
    passed_over: int = 0  # steps it could have joined and did not, since it last did (node_agent.batching)

    @property
    def in_prefill(self) -> bool:
        return self.computed_tokens < self.prompt_tokens


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    """``num_tokens`` inputs of one request at positions ``first_position..``; ``ends_prompt_or_decodes``
    is True when the next token after this work is due (a decode, or the prompt's last chunk)."""

    request_id: str
    num_tokens: int
    first_position: int
    is_prefill: bool
    ends_prompt_or_decodes: bool


@dataclass(slots=True)
class Batch:
    """What runs in one step: decodes first (FCFS), then prefill chunks or several whole prompts."""

    work: list[ScheduledWork] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)  # could have joined, did not (not under fcfs)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)

    @property
    def num_prefill_chunks(self) -> int:
        return sum(w.is_prefill for w in self.work)

    def __bool__(self) -> bool:
        return bool(self.work)


_ADMISSION = attrgetter("order")


def _rows(seq: SequenceState) -> int:
    """The rows a ready request would run in a step (before the step's token limits)."""
    return min(seq.pending_tokens, seq.prompt_tokens - seq.computed_tokens) if seq.in_prefill else 1


class Scheduler:
    """FCFS admission with KV reservation; decodes plus ``chunk_size`` prefill tokens, or plus whole prompts."""

    def __init__(self, config: SchedulerConfig, kv: KVAccount) -> None:
        self.config, self.kv = config, kv
        self.waiting: deque[SequenceState] = deque()
        self.running: dict[str, SequenceState] = {}  # insertion order = admission order (FCFS)
        self._all: dict[str, SequenceState] = {}
        # the running requests with pending input: a step looks at these only (a pipeline stage holds many
        # requests, most of them waiting for their next token elsewhere)
        self._ready: dict[str, SequenceState] = {}
        self._admissions = 0

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int, pending_tokens: int = 0, *,
            task: str | None = None, pet_type: str | None = None) -> None:  # fmt: skip
        """Queue a request (running ``task`` of ``pet_type``; None: the base model); raises
        ``CapacityError`` if its reservation could never fit."""
        if request_id in self._all:
            raise EngineError(f"request {request_id!r} already exists on this stage")
        reserve = prompt_tokens + max_tokens
        self.kv.check_fits_ever(request_id, reserve)
        seq = SequenceState(request_id, prompt_tokens, reserve, pending_tokens=pending_tokens, task=task,
                            pet_type=pet_type)  # fmt: skip
        self.waiting.append(seq)
        self._all[request_id] = seq

    def add_input(self, request_id: str, num_tokens: int) -> None:
        """``num_tokens`` more inputs arrived for ``request_id``."""
        seq = self._all[request_id]
        seq.pending_tokens += num_tokens
        if seq.pending_tokens and request_id in self.running:
            self._ready[request_id] = seq

    def remove(self, request_id: str) -> None:
        """Drop a request (finished or cancelled) and release its KV reservation."""
        seq = self._all.pop(request_id, None)
        if seq is None:
            return
        if self.running.pop(request_id, None) is None:
            self.waiting.remove(seq)
        self._ready.pop(request_id, None)
        self.kv.release(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._all

    @property
    def has_unfinished(self) -> bool:
        return bool(self._all)

    def kv_usage(self) -> KVUsage:
        return self.kv.usage(sum(s.computed_tokens for s in self.running.values()))

    def _admit(self) -> list[str]:
        if self.config.request_level and self.running:
            return []
        admitted = []
        policy = self.config.batching
        if policy.fcfs:
            while self.waiting and len(self.running) < self.config.max_batch_size:
                head = self.waiting[0]
                if not self.kv.can_reserve(head.reserve_tokens):
                    break  # strict FCFS: no overtaking, so no starvation
                self.waiting.popleft()
                admitted.append(self._start(head))
            return admitted
        slots = self.config.max_batch_size - len(self.running)
        for seq in admission_order(policy, self.waiting, self.running.values(), slots):
            if not self.kv.can_reserve(seq.reserve_tokens):
                break  # no overtaking in the policy's order (forced requests first), so the bound holds
            self.waiting.remove(seq)
            admitted.append(self._start(seq))
        return admitted

    def _start(self, seq: SequenceState) -> str:
        self.kv.reserve(seq.request_id, seq.reserve_tokens)
        self.running[seq.request_id] = seq
        seq.order = self._admissions
        self._admissions += 1
        if seq.pending_tokens:
            self._ready[seq.request_id] = seq
        return seq.request_id

    def schedule(self) -> Batch:
        """Pick this step's work. Pure: nothing changes until :meth:`update`."""
        policy = self.config.batching
        # under a policy: the waiting requests FCFS would admit now (passed over unless admitted)
        slots = max(0, self.config.max_batch_size - len(self.running))
        turn = [] if policy.fcfs else [s.request_id for s in islice(self.waiting, slots)]
        batch = Batch(admitted=self._admit())
        budget = self.config.token_budget
        ready = sorted(self._ready.values(), key=_ADMISSION) if len(self._ready) > 1 else list(self._ready.values())
        if policy.mode is BatchingMode.BETA:
            ready = beta_only_ready(policy, ready, _rows)
        if not policy.fcfs:
            ready.sort(key=lambda seq: not policy.forced(seq))  # forced first (their prefill chunks too)
        for seq in ready:
            if budget and not seq.in_prefill:
                batch.work.append(ScheduledWork(seq.request_id, 1, seq.computed_tokens, False, True))
                budget -= 1
        chunk = self.config.chunk_size
        for seq in ready:
            if not seq.in_prefill:
                continue
            todo = min(seq.pending_tokens, seq.prompt_tokens - seq.computed_tokens)
            if chunk is not None:
                todo = min(todo, chunk, budget)
                if todo <= 0:
                    break  # the step's prefill tokens are spent
                batch.work.append(ScheduledWork(seq.request_id, todo, seq.computed_tokens, True,
                                                seq.computed_tokens + todo == seq.prompt_tokens))
                chunk, budget = chunk - todo, budget - todo  # Sarathi: chunk_size prefill tokens per step in all
                continue
            if batch.num_prefill_chunks and todo > budget:
                break  # Orca: whole prompts while they fit; FCFS, so no younger prompt overtakes
            batch.work.append(ScheduledWork(seq.request_id, todo, seq.computed_tokens, True,
                                            seq.computed_tokens + todo == seq.prompt_tokens))
            budget = max(0, budget - todo)
        if not policy.fcfs:
            ran = {w.request_id for w in batch.work}
            batch.passed_over = [r for r in self._ready if r not in ran]
            batch.passed_over += [r for r in turn if r not in self.running]
        return batch

    def update(self, batch: Batch, finished: Iterable[str] = ()) -> None:
        """Account the work a step ran, then drop the requests that finished in it."""
        for request_id in batch.passed_over:
            if (passed := self._all.get(request_id)) is not None:
                passed.passed_over += 1
        for work in batch.work:
            seq = self._all.get(work.request_id)
            if seq is not None:
                seq.passed_over = 0
                seq.computed_tokens += work.num_tokens
                seq.pending_tokens -= work.num_tokens
                if not seq.pending_tokens:
                    self._ready.pop(work.request_id, None)
        for request_id in finished:
            self.remove(request_id)
