"""The stage executor: one partial-layer engine that an agent drives with ``step()``.

A :class:`StageEngine` holds layers ``[layer_start, layer_end)`` of a model, a KV account and a
:class:`~node_agent.scheduler.Scheduler`. It is single-threaded and step-driven, with no I/O:

* ``add_request`` admits a request carrying a layer sub-range inside the stage (default: the
  whole stage ∩ the rest of the model). If the sub-range starts at layer 0 its input is prompt
  token ids; otherwise hidden states arrive through ``push_hidden``.
* ``step`` runs one iteration: the scheduled rows of every request are flattened into one
  tensor (selective batching), each request runs exactly its sub-range, and the step returns,
  per request, either outgoing hidden states (sub-range ends before the last layer) or a
  sampled token (sub-range ends at the last layer).
* A token sampled elsewhere comes back through ``push_token``; when one engine runs a request's
  whole model it loops the token back itself, unless the request is ``paced`` (its caller decides
  whether the next step runs, e.g. after a stop string: it pushes the token back or cancels).
* The layers held may change while it serves (issue 18): :mod:`node_agent.stage_layers` says what
  a new range ``[c, d)`` lacks and builds it (any thread), :meth:`StageEngine.insert_layers` adds
  it between two steps (the engine then holds the union, and ``[c, d)`` is its range) and
  :meth:`~StageEngine.drop_layers` frees the layers outside a range that no request runs. A
  request's KV holds only its own layers, so requests admitted on the old range run on unchanged.
* Fine-tuned tasks (:mod:`node_agent.pets`) are bound with ``add_task`` (the stage keeps only the
  PET of its own layers) and named per request (``add_request(..., task=...)``); one step batches
  the rows of many tasks and of the base model. Torch backend only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from helix.domain import LayerRange
from helix.errors import EngineError, RequestError, UnknownTaskError
from node_agent.backends import StageBackend, build_stage_model
from node_agent.config import ModelConfig, load_config
from node_agent.grammar import GrammarTokenizer
from node_agent.kv_cache import KVAccount, KVUsage, RequestKV
from node_agent.model import Segment, StageModel, StageParts
from node_agent.pets import TaskPET
from node_agent.sampling import RequestSampler, SamplingParams, finish_reason
from node_agent.scheduler import Batch, Scheduler, SchedulerConfig
from node_agent.stage_layers import describe_spans, spans
from node_agent.stage_task import StageTask, bind_task
from node_agent.task_ops import TaskRows
from node_agent.weights import load_tensors


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in a step: ``hidden`` for the next stage, or a sampled ``token``."""

    request_id: str
    num_tokens: int
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size], when the sub-range ends mid-model
    token: int | None = None  # sampled, when the sub-range ends at the last layer
    finish_reason: str | None = None  # "stop" | "length" once the request is done
    logits: torch.Tensor | None = None  # [vocab], if SamplingParams.return_logits


@dataclass(slots=True)
class StepResult:
    outputs: list[RequestOutput]
    num_tokens: int
    num_prefill_tokens: int
    # what ran, by the first layer the requests entered at: layer -> (prefill tokens, decoding requests,
    # their context tokens); the shape of the simulator's iteration cost (a request entering mid-range
    # runs only its layers)
    by_start: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class _Request:
    request_id: str
    layer_start: int
    layer_end: int
    sampling: SamplingParams
    sampler: RequestSampler | None  # on the stage that ends the model
    pending_ids: list[int]
    pending_hidden: torch.Tensor | None = None
    kv: RequestKV | None = None
    num_generated: int = 0
    task: StageTask | None = None  # held by the request: unbinding the task lets it finish


class StageEngine:
    """Layers ``[layer_start, layer_end)`` of one model, batched at iteration granularity."""

    def __init__(self, model_dir: str | Path, layer_start: int = 0, layer_end: int | None = None, *,
                 kv_capacity_tokens: int = 65536, scheduler: SchedulerConfig | None = None,
                 backend: StageBackend | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.config: ModelConfig = load_config(model_dir)
        end = self.config.num_layers if layer_end is None else layer_end
        if end == layer_start:  # no layers yet (an agent that joins): its range comes later
            layer_start = end = 0
        self.backend = backend or StageBackend()
        self.model = build_stage_model(model_dir, self.config, layer_start, end, self.backend)
        self.layer_start, self.layer_end = layer_start, end  # the stage's range (the latest one it was given)
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), KVAccount(kv_capacity_tokens))
        self.grammars = GrammarTokenizer(model_dir, self.config.vocab_size, self.config.eos_token_ids)  # read lazily
        self._requests: dict[str, _Request] = {}
        self._tasks: dict[str, StageTask] = {}
        self._task_ranges: dict[str, tuple[int, int]] = {}  # the layers each task was bound for

    # ---- fine-tuned tasks --------------------------------------------------------------------
    def add_task(self, task_id: str, pet: TaskPET, *, max_lora_rank: int | None = None) -> StageTask:
        """Bind a task's PET (whole-model or already sliced) to this stage: only its layers are kept.

        Raises ``PETError`` naming the tensor if it does not fit the base; replaces a task of the
        same id for new requests (requests in flight keep the PET they started with).
        """
        if self.backend.name != "torch":
            raise EngineError(f"backend {self.backend}: fine-tuned tasks (PETs) run on the torch backend only "
                              f"(task {task_id!r})")  # fmt: skip
        task = bind_task(task_id, pet, self.config, self.layer_start, self.layer_end, dtype=self.model.dtype,
                         device=self.model.device, max_lora_rank=max_lora_rank,
                         base_weights=lambda names: load_tensors(self.model_dir, names))  # fmt: skip
        self._tasks[task_id] = task
        self._task_ranges[task_id] = (self.layer_start, self.layer_end)
        return task

    def remove_task(self, task_id: str) -> None:
        """Unbind a task; its requests in flight finish with it. Unknown ids are ignored."""
        self._tasks.pop(task_id, None)
        self._task_ranges.pop(task_id, None)

    @property
    def tasks(self) -> dict[str, StageTask]:
        """The tasks bound to this stage, by id."""
        return dict(self._tasks)

    # ---- request lifecycle -------------------------------------------------------------------
    def add_request(self, request_id: str, sampling: SamplingParams, *,
                    prompt_token_ids: list[int] | None = None, prompt_len: int | None = None,
                    layer_range: tuple[int, int] | None = None, task: str | None = None) -> None:
        """Queue a request. Stage-local sub-range ``layer_range`` defaults to the whole stage.

        ``task`` names a task bound with :meth:`add_task` (``None``: the base model); an unknown
        one raises ``UnknownTaskError``.

        A sub-range starting at layer 0 needs ``prompt_token_ids``; any other needs ``prompt_len``
        (its hidden states come through :meth:`push_hidden`). Raises ``CapacityError`` when the
        request's KV reservation (prompt + max_tokens) exceeds the stage's whole capacity.
        """
        start, end = layer_range or (self.layer_start, self.layer_end)
        bound = None
        if task is not None:
            if self.backend.name != "torch":
                raise RequestError(f"request {request_id!r} names task {task!r}, but backend {self.backend} "
                                   f"serves only the base model (tasks run on the torch backend)", param="task")
            if task not in self._tasks:
                raise UnknownTaskError(f"request {request_id!r}: task {task!r} is not loaded on stage "
                                       f"[{self.layer_start}, {self.layer_end})", task=task)  # fmt: skip
            bound = self._tasks[task]
            bound_start, bound_end = self._task_ranges[task]
            if not bound_start <= start < end <= bound_end:
                raise UnknownTaskError(f"request {request_id!r}: task {task!r} is bound to layers [{bound_start}, "
                                       f"{bound_end}) of this stage, not to all of [{start}, {end}) (load it again "
                                       f"after the stage's layers changed)", task=task)  # fmt: skip
        if not (start < end and self.holds(start, end)):
            raise RequestError(f"layer range [{start}, {end}) is not inside the layers this stage holds "
                               f"({describe_spans(self.held)})", param="layer_range")
        if start == 0:
            if not prompt_token_ids:
                raise RequestError("a request starting at layer 0 needs prompt_token_ids", param="prompt_token_ids")
            if not all(0 <= t < self.config.vocab_size for t in prompt_token_ids):
                raise RequestError(f"prompt token ids must be in [0, {self.config.vocab_size})",
                                   param="prompt_token_ids")
            prompt_len = len(prompt_token_ids)
        elif not prompt_len:
            raise RequestError("a request starting past layer 0 needs prompt_len", param="prompt_len")
        ends_model = end == self.config.num_layers
        sampler = RequestSampler(sampling, self.config.vocab_size, self.grammars) if ends_model else None
        self.scheduler.add(request_id, prompt_len, sampling.max_tokens,
                           pending_tokens=prompt_len if start == 0 else 0, task=task,
                           pet_type=None if bound is None else str(bound.pet_type))  # fmt: skip
        self._requests[request_id] = _Request(request_id, start, end, sampling,
                                              sampler,
                                              list(prompt_token_ids or []), task=bound)

    def push_hidden(self, request_id: str, hidden: torch.Tensor) -> None:
        """Hidden states ``[n, hidden_size]`` from the previous stage for the request's next n tokens."""
        req = self._request(request_id)
        if req.layer_start == 0:
            raise RequestError(f"request {request_id!r} starts at layer 0: push tokens, not hidden states")
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise EngineError(f"hidden states for {request_id!r} have shape {tuple(hidden.shape)}, "
                              f"expected [n, {self.config.hidden_size}]")
        hidden = hidden.to(self.model.device, self.model.dtype)
        req.pending_hidden = hidden if req.pending_hidden is None else torch.cat([req.pending_hidden, hidden])
        self.scheduler.add_input(request_id, hidden.shape[0])

    def push_token(self, request_id: str, token_id: int) -> None:
        """The token sampled for ``request_id`` (by the last stage) to decode next."""
        req = self._request(request_id)
        if req.layer_start != 0:
            raise RequestError(f"request {request_id!r} does not start at layer 0: push hidden states")
        req.pending_ids.append(token_id)
        self.scheduler.add_input(request_id, 1)

    def _request(self, request_id: str) -> _Request:
        if request_id not in self._requests:
            raise RequestError(f"unknown request {request_id!r} on stage [{self.layer_start}, {self.layer_end})")
        return self._requests[request_id]

    def cancel(self, request_id: str) -> None:
        """Forget a request (finished elsewhere, aborted) and free its KV. Unknown ids are ignored."""
        self._requests.pop(request_id, None)
        self.scheduler.remove(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- the layers held ---------------------------------------------------------------------
    @property
    def held(self) -> tuple[LayerRange, ...]:
        """The layers this stage holds, as ascending ranges (several after a re-plan added a range)."""
        if isinstance(self.model, StageModel):
            return spans(self.model.layers)
        return (LayerRange(self.layer_start, self.layer_end),) if self.layer_end > self.layer_start else ()

    def holds(self, start: int, end: int) -> bool:
        return any(r.start <= start and end <= r.end for r in self.held)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights held (0 where the backend does not say)."""
        return self.model.nbytes if isinstance(self.model, StageModel) else 0

    def layer_model(self) -> StageModel:
        """The model whose layers change while it serves (EngineError on a backend whose layers do not)."""
        if not isinstance(self.model, StageModel):
            raise EngineError(f"backend {self.backend}: the layers a stage holds change while it serves on the "
                              f"torch backend only")  # fmt: skip
        return self.model

    def insert_layers(self, parts: StageParts, start: int, end: int) -> None:
        """Hold ``parts`` too (between two steps); ``[start, end)`` (held now) becomes the stage's range."""
        self.layer_model().insert(parts)
        assert self.holds(start, end), f"[{start}, {end}) is not held after inserting its layers"
        self.layer_start, self.layer_end = start, end

    def requests_on(self, layers: set[int]) -> list[str]:
        """The requests whose sub-range runs any of ``layers``."""
        return [r.request_id for r in self._requests.values() if not layers.isdisjoint(range(r.layer_start,
                                                                                             r.layer_end))]

    def drop_layers(self, keep_start: int, keep_end: int) -> tuple[int, ...]:
        """Free the layers held outside ``[keep_start, keep_end)`` that no request runs; those it frees."""
        model = self.layer_model()
        outside = {i for i in model.layers if not keep_start <= i < keep_end}
        for rid in self.requests_on(outside):
            outside -= set(range(self._requests[rid].layer_start, self._requests[rid].layer_end))
        model.drop(outside)
        return tuple(sorted(outside))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule and run one iteration; an empty result means nothing could run."""
        batch = self.scheduler.schedule()
        if not batch:
            return StepResult([], 0, 0)
        self._group_by_task(batch)
        with torch.inference_mode():
            segments, hidden = self._gather(batch)
            hidden = self.model.forward(hidden, segments)
            outputs, finished = self._emit(batch, segments, hidden)
        by_start: dict[int, tuple[int, int, int]] = {}
        for work in batch.work:
            start = self._requests[work.request_id].layer_start
            prefill, decodes, context = by_start.get(start, (0, 0, 0))
            if work.is_prefill:
                by_start[start] = (prefill + work.num_tokens, decodes, context)
            else:  # attends over every position up to its own
                by_start[start] = (prefill, decodes + 1, context + work.first_position + 1)
        self.scheduler.update(batch, finished)
        for request_id in finished:
            del self._requests[request_id]
        return StepResult(outputs, batch.num_tokens, sum(w.num_tokens for w in batch.work if w.is_prefill), by_start)

    def _group_by_task(self, batch: Batch) -> None:
        """Put the rows of each task next to each other (the base's first; stable otherwise), so that
        a task's PET op runs on one span of the step's rows, with no gather and no scatter (an
        optimisation only: rows in any order give the same result)."""
        if not self._tasks:
            return
        first_seen: dict[int, int] = {}
        keys = []
        for work in batch.work:
            task = self._requests[work.request_id].task
            keys.append(-1 if task is None else first_seen.setdefault(id(task), len(first_seen)))
        if first_seen:
            batch.work[:] = [work for _, work in sorted(zip(keys, batch.work, strict=True), key=lambda kw: kw[0])]

    def _gather(self, batch: Batch) -> tuple[list[Segment], torch.Tensor]:
        rows: list[torch.Tensor] = []
        segments: list[Segment] = []
        offset = 0
        cfg = self.config
        for work in batch.work:
            req, n = self._requests[work.request_id], work.num_tokens
            if req.kv is None:
                req.kv = RequestKV(req.layer_start, req.layer_end, cfg.num_kv_heads, cfg.head_dim,
                                   self.scheduler.running[work.request_id].reserve_tokens,
                                   dtype=self.model.dtype, device=self.model.device)
            if req.layer_start == 0:
                ids, req.pending_ids = req.pending_ids[:n], req.pending_ids[n:]
                rows.append(self.model.embed(torch.tensor(ids, dtype=torch.long)))
            else:
                assert req.pending_hidden is not None
                rows.append(req.pending_hidden[:n])
                req.pending_hidden = req.pending_hidden[n:] if req.pending_hidden.shape[0] > n else None
            segments.append(Segment(slice(offset, offset + n), req.kv, work.first_position,
                                    req.layer_start, req.layer_end, req.task))
            offset += n
        return segments, torch.cat(rows)

    def _emit(self, batch: Batch, segments: list[Segment],
              hidden: torch.Tensor) -> tuple[list[RequestOutput], list[str]]:
        outputs: list[RequestOutput] = []
        sample_rows: list[int] = []
        to_sample: list[RequestOutput] = []
        for work, seg in zip(batch.work, segments, strict=True):
            req = self._requests[work.request_id]
            out = RequestOutput(work.request_id, work.num_tokens)
            outputs.append(out)
            if req.layer_end < self.config.num_layers:
                out.hidden = hidden[seg.rows].to("cpu", copy=True)
            elif work.ends_prompt_or_decodes:
                sample_rows.append(seg.rows.stop - 1)
                to_sample.append(out)
        finished: list[str] = []
        if sample_rows:
            heads = [self._requests[o.request_id].task for o in to_sample]
            tasks = TaskRows.group(((t, slice(i, i + 1)) for i, t in enumerate(heads)), hidden.device) \
                if any(t is not None and t.has_head_bias for t in heads) else None
            logits = self.model.logits(hidden[sample_rows], tasks)
            for out, row in zip(to_sample, logits, strict=True):
                req = self._requests[out.request_id]
                assert req.sampler is not None
                out.token = req.sampler.sample(row)
                req.num_generated += 1
                out.logits = row.clone() if req.sampling.return_logits else None
                out.finish_reason = finish_reason(out.token, req.num_generated, req.sampling,
                                                  grammar_done=req.sampler.grammar_done)
                if out.finish_reason:
                    finished.append(out.request_id)
                elif req.layer_start == 0 and not req.sampling.paced:  # it runs the whole model here: loop back
                    req.pending_ids.append(out.token)
                    self.scheduler.add_input(out.request_id, 1)
        return outputs, finished
