"""An in-process chain of stage engines: the reference driver for tests and benchmarks.

:class:`LocalPipeline` does, without sockets, what the ZeroMQ agents and the router do across
machines: it steps each stage in pipeline order, hands a stage's outgoing hidden states to the
next stage, returns sampled tokens to the first stage, and cancels a finished request on every
stage. An agent wrapper replaces the direct calls with wire messages.
"""

from __future__ import annotations

from node_agent.engine import RequestOutput, StageEngine
from node_agent.sampling import SamplingParams


class LocalPipeline:
    """Stages with contiguous layer ranges covering the whole model, in order."""

    def __init__(self, engines: list[StageEngine]) -> None:
        for prev, nxt in zip(engines, engines[1:], strict=False):
            assert prev.layer_end == nxt.layer_start, "stages must be contiguous"
        assert engines[0].layer_start == 0 and engines[-1].layer_end == engines[-1].config.num_layers
        self.engines = engines

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                    task: str | None = None) -> None:
        """Queue a request on every stage; ``task`` names a fine-tuned task bound on each (None: the base)."""
        first, *rest = self.engines
        first.add_request(request_id, sampling, prompt_token_ids=prompt_token_ids, task=task)
        for engine in rest:
            engine.add_request(request_id, sampling, prompt_len=len(prompt_token_ids), task=task)

    @property
    def has_unfinished(self) -> bool:
        return any(e.has_unfinished for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every stage, in order; returns the sampled-token outputs of the last stage."""
        sampled: list[RequestOutput] = []
        for i, engine in enumerate(self.engines):
            for out in engine.step().outputs:
                if out.hidden is not None:
                    self.engines[i + 1].push_hidden(out.request_id, out.hidden)
                elif out.token is not None:
                    sampled.append(out)
                    if out.finish_reason:
                        for other in self.engines[:-1]:
                            other.cancel(out.request_id)
                    elif len(self.engines) > 1:
                        self.engines[0].push_token(out.request_id, out.token)
        return sampled
