"""A thin wrapper over highspy for the planner's small MILPs/LPs (stage patterns, bounds,
the serving LP). One place knows the highspy API; the callers state rows and columns.

It also owns HiGHS's output: :func:`new_highs` makes instances that print nothing. Their log
goes to this module's logger at DEBUG (``helix -vv``), and the banner HiGHS writes to the C
stdout when a process makes its first instance is swallowed (:func:`quiet_banner`; it would
otherwise land in ``helix plan --json``'s output) and logged at DEBUG too.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import highspy
import numpy as np

INF = highspy.kHighsInf

log = logging.getLogger(__name__)
_banner_lock = threading.Lock()
_banner_done = False


def _flush_c_stdout() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - no libc to flush
        pass


def quiet_banner() -> None:
    """Make this process's first HiGHS instance with the C stdout redirected (HiGHS prints its
    banner there once per process); the banner goes to the DEBUG log instead."""
    global _banner_done
    with _banner_lock:
        if _banner_done:
            return
        _banner_done = True
        try:
            sys.stdout.flush()
            saved = os.dup(1)
        except (OSError, ValueError):  # no usable stdout: nothing to protect
            highspy.Highs()
            return
        with tempfile.TemporaryFile() as tmp:
            try:
                os.dup2(tmp.fileno(), 1)
                highspy.Highs()
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


def new_highs() -> highspy.Highs:
    """A HiGHS instance that writes nothing to the console (its log: DEBUG on this logger)."""
    quiet_banner()
    h = highspy.Highs()
    if solver_log_wanted():
        h.setOptionValue("output_flag", True)
        h.setOptionValue("log_to_console", False)
        h.cbLogging.subscribe(_on_log)
    else:
        h.setOptionValue("output_flag", False)
    return h


def _on_log(event: Any) -> None:
    log_solver_line(str(getattr(event, "message", "")))


@dataclass(slots=True)
class Solution:
    status: str  # "optimal" | "infeasible" | "time_limit" | "iteration_limit" | other HiGHS status text
    x: list[float]
    objective: float
    dual_bound: float


@dataclass(slots=True)
class Model:
    """Columns with bounds/cost/integrality, rows as sparse (index, value) lists."""

    maximize: bool = False
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)
    quadratic: dict[int, float] = field(default_factory=dict)  # column -> Q_jj of the cost's ½ x'Qx

    def add_col(self, lo: float = 0.0, hi: float = INF, cost: float = 0.0, integer: bool = False) -> int:
        self.lower.append(lo)
        self.upper.append(hi)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lower) - 1

    def add_row(self, idx: list[int], val: list[float], lo: float = -INF, hi: float = INF) -> None:
        self.rows.append((idx, val, lo, hi))

    def solve(
        self, *, time_limit_s: float = 30.0, threads: int = 1, mip_gap: float = 1e-6, options: dict[str, Any] | None = None
    ) -> Solution:
        h = new_highs()
        for name, value in (options or {}).items():
            h.setOptionValue(name, value)
        h.setOptionValue("time_limit", max(0.01, float(time_limit_s)))
        h.setOptionValue("threads", int(max(1, threads)))
        h.setOptionValue("mip_rel_gap", mip_gap)
        h.setOptionValue("random_seed", 0)
        n = len(self.lower)
        lp = highspy.HighsLp()
        lp.num_col_ = n
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = np.array(self.cost, dtype=float)
        lp.col_lower_ = np.array(self.lower, dtype=float)
        lp.col_upper_ = np.array(self.upper, dtype=float)
        lp.row_lower_ = np.array([r[2] for r in self.rows], dtype=float)
        lp.row_upper_ = np.array([r[3] for r in self.rows], dtype=float)
        lp.sense_ = highspy.ObjSense.kMaximize if self.maximize else highspy.ObjSense.kMinimize
        start, index, value = [0], [], []
        for idx, val, _, _ in self.rows:
            index.extend(idx)
            value.extend(val)
            start.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(start, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=float)
        if any(self.integer):
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer
            ]
        h.passModel(lp)
        if self.quadratic:
            h.passHessian(self._hessian(n))
        run(h)
        status = h.getModelStatus()
        text = h.modelStatusToString(status).lower()
        info = h.getInfo()
        has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
        x = list(h.getSolution().col_value) if has_sol else []
        if status == highspy.HighsModelStatus.kOptimal:
            text = "optimal"
        elif status == highspy.HighsModelStatus.kInfeasible:
            text = "infeasible"
        elif status == highspy.HighsModelStatus.kTimeLimit:
            text = "time_limit"
        elif status == highspy.HighsModelStatus.kIterationLimit:
            text = "iteration_limit"
        obj = info.objective_function_value if has_sol else float("nan")
        bound = getattr(info, "mip_dual_bound", obj) if any(self.integer) else obj
        return Solution(status=text, x=x, objective=obj, dual_bound=bound)

    def _hessian(self, n: int) -> highspy.HighsHessian:
        """The diagonal Hessian of :attr:`quadratic` (triangular format, one entry a column)."""
        hs = highspy.HighsHessian()
        hs.dim_ = n
        hs.format_ = highspy.HessianFormat.kTriangular
        start, index, value = [0], [], []
        for j in range(n):
            if j in self.quadratic:
                index.append(j)
                value.append(self.quadratic[j])
            start.append(len(index))
        hs.start_ = np.array(start, dtype=np.int32)
        hs.index_ = np.array(index, dtype=np.int32)
        hs.value_ = np.array(value, dtype=float)
        return hs


def run(h: highspy.Highs) -> None:
    """``h.run()``; if HiGHS refuses (its process-wide scheduler pinned to another thread
    count by an earlier solve), reset the scheduler and try once more."""
    if h.run() != highspy.HighsStatus.kError:
        return
    reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
    if reset is not None:
        reset(True)
        h.run()


def highs_version() -> str:
    h = new_highs()
    try:
        return f"highs {h.version()}"
    except Exception:  # pragma: no cover - older highspy
        return "highs"
