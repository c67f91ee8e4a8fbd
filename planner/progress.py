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
    message: str = ""


ProgressFn = Callable[[Progress], None]
