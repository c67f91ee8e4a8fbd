"""The per-iteration limits of the paper's vLLM nodes (docs/simulator.md, "Where the nodes differ from the
agents"): what one iteration may hold, trimmed from the agents' scheduler's batch by :mod:`simulator.nodes`."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.scheduler import Batch


@dataclass(frozen=True, slots=True)
class IterationLimits:
    """What one iteration of the paper's vLLM nodes may hold (its artifact's ``execution_policy.py``):
    at most ``decodes`` decoding requests whose contexts sum to at most ``decode_context``, and, with
    whole prompts (``chunked`` False), at most ``prompt_tokens`` prompt tokens in at most ``prompts``
    prompts (the first prompt always runs). ``None``: no such limit."""

    decodes: int
    prompt_tokens: int
    prompts: int | None = None
    decode_context: float | None = None
    chunked: bool = False

    def trim(self, batch: Batch) -> Batch:
        """``batch`` less what passes the limits; what is left out stays pending for a later iteration.
        Decodes that do not fit are skipped (a shorter context may still fit), prompts stop at the first
        that does not (first come, first served, as the scheduler takes them)."""
        if len(batch.work) < 2:  # the first decode and the first prompt always run
            return batch
        work, cut = [], False
        decodes = prompts = tokens = context = 0
        for w in batch.work:
            if not w.is_prefill:
                ctx = w.first_position + 1
                if decodes >= self.decodes or (self.decode_context is not None and decodes
                                               and context + ctx > self.decode_context):  # fmt: skip
                    cut = True
                    continue
                decodes += 1
                context += ctx
            elif not self.chunked:
                if prompts and (tokens + w.num_tokens > self.prompt_tokens
                                or (self.prompts is not None and prompts >= self.prompts)):  # fmt: skip
                    cut = True
                    break
                prompts += 1
                tokens += w.num_tokens
            work.append(w)
        return Batch(work, batch.admitted) if cut else batch

    def passed(self, decodes: int, context: int, prompts: int, prompt_tokens: int) -> bool:
        """Whether a batch of these totals passes the limits (:meth:`trim` would cut it)."""
        if decodes > self.decodes or (self.decode_context is not None and decodes > 1 and context > self.decode_context):
            return True
        return not self.chunked and prompts > 1 and (prompt_tokens > self.prompt_tokens
                                                     or (self.prompts is not None and prompts > self.prompts))  # fmt: skip
