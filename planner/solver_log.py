"""The solvers' own output: never on the console, at DEBUG on this module's logger (``helix -vv``).

HiGHS writes a banner to the C stdout when a process makes its first instance; it would land in
``helix plan --json``'s output, so :func:`quiet_banner` makes that first instance with the C
stdout redirected and logs the banner at DEBUG. The solver layer (``planner.solvers``) routes
every HiGHS log line here (:func:`log_solver_line`) when :func:`solver_log_wanted`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_banner_lock = threading.Lock()
_banner_done = False


def _flush_c_stdout() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - no libc to flush
        pass


def quiet_banner(first_instance: Callable[[], object]) -> None:
    """Make this process's first HiGHS instance (``first_instance()``) with the C stdout redirected
    (HiGHS prints its banner there once per process); the banner goes to the DEBUG log instead."""
    global _banner_done
    with _banner_lock:
        if _banner_done:
            return
        _banner_done = True
        try:
            sys.stdout.flush()
            saved = os.dup(1)
        except (OSError, ValueError):  # no usable stdout: nothing to protect
            first_instance()
            return
        with tempfile.TemporaryFile() as tmp:
            try:
                os.dup2(tmp.fileno(), 1)
                first_instance()
                _flush_c_stdout()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace").strip()
    if text:
        log.debug("%s", text)


def solver_log_wanted() -> bool:
    """Whether the solvers' own log is wanted (DEBUG logging, ``helix -vv``)."""
    return log.isEnabledFor(logging.DEBUG)


def log_solver_line(message: str) -> None:
    log.debug("%s", message.rstrip())
