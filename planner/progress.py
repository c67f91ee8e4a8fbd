"""What a running solve reports: incumbent, proven bound, elapsed time (for progress lines)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Progress:
    """One progress report of a running solve (tokens/s; ``None`` when not known yet)."""

    incumbent_tok_s: float | None
    bound_tok_s: float | None
    elapsed_s: float
    message: str = ""  # the phase (construction, bound, local search, done (stop reason))
    serving_tok_s: float | None = None  # the incumbent's serving estimate (objective "serving")


ProgressFn = Callable[[Progress], None]
