"""The planner's solver layer: the one module that speaks to highspy and to pulp.

* :class:`Model` — an LP/MILP/QP stated as columns and sparse rows, solved by highspy directly
  (the stage patterns, the bounds, the balanced-flow QP, the serving LP): :meth:`Model.solve`
  gives a :class:`Solution` (values, objective, dual bound, and row duals for an LP).
* :func:`solve_pulp` — a pulp model solved with HiGHS (default), CBC or Gurobi, with threads,
  a time limit, a warm start, progress and an early stop; :func:`new_problem`,
  :func:`add_variable` and :func:`lp_sum` state such a model (the paper's MILP, ``planner.milp``,
  is written in pulp so that ``--solver`` may pick any of the three).

Every HiGHS instance prints nothing: its log and its start-up banner go to ``planner.solver_log``
(DEBUG, ``helix -vv``), never to the console or ``helix plan --json``'s output.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import highspy
import numpy as np
import pulp

from helix.errors import ConfigError
from planner.progress import Progress, ProgressFn
from planner.solver_log import log_solver_line, quiet_banner, solver_log_wanted

INF = highspy.kHighsInf
SOLVERS = ("highs", "cbc", "gurobi")


def new_highs() -> highspy.Highs:
    """A HiGHS instance that writes nothing to the console (its log: DEBUG, ``planner.solver_log``)."""
    quiet_banner(highspy.Highs)
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


# -- highspy: models stated as columns and rows ----------------------------------------------


@dataclass(slots=True)
class Solution:
    status: str  # "optimal" | "infeasible" | "time_limit" | "iteration_limit" | other HiGHS status text
    x: list[float]
    objective: float
    dual_bound: float
    row_dual: list[float] = field(default_factory=list)  # an LP's row duals (empty for a MILP)


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
        solution = h.getSolution() if has_sol else None
        x = list(solution.col_value) if solution is not None else []
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
        duals = list(solution.row_dual) if solution is not None and not any(self.integer) else []
        return Solution(status=text, x=x, objective=obj, dual_bound=bound, row_dual=duals)

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


# -- pulp: the paper's MILP, with any of its solvers ------------------------------------------


def new_problem(name: str, *, maximize: bool) -> Any:
    """An empty pulp model (state it with :func:`add_variable`, :func:`lp_sum` and ``prob += ...``)."""
    return pulp.LpProblem(name, pulp.LpMaximize if maximize else pulp.LpMinimize)


def add_variable(prob: Any, name: str, low: float | None = None, up: float | None = None, *,
                 kind: str = "continuous") -> Any:
    """A variable of ``prob``: ``kind`` is ``continuous``, ``integer`` or ``binary``."""
    cat = {"continuous": pulp.LpContinuous, "integer": pulp.LpInteger, "binary": pulp.LpBinary}[kind]
    if hasattr(prob, "add_variable"):  # pulp >= 3.3
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def lp_sum(terms: Any) -> Any:
    """The sum of pulp expressions (``pulp.lpSum``)."""
    return pulp.lpSum(terms)


@dataclass(slots=True)
class SolveOutcome:
    """What :func:`solve_pulp` found: status text, objective, best proven bound, solver name."""

    status: str
    objective: float | None
    bound: float | None
    solver: str
    wall_s: float
    stopped_early: bool = False


def _highs_solver_class() -> type:
    """pulp's HiGHS (highspy) API, plus a warm start (``setSolution``) it lacks."""

    class _HiGHSWarm(pulp.HiGHS):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, initial: dict[str, float] | None = None, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.initial = initial

        def callSolver(self, lp: Any) -> None:  # noqa: N802 - pulp's name
            if self.initial:
                idx, val = [], []
                for var in lp.variables():
                    if var.name in self.initial:
                        idx.append(var.index)
                        val.append(float(self.initial[var.name]))
                lp.solverModel.setSolution(len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
            if solver_log_wanted():  # the log goes to the DEBUG logger (helix -vv), never the console
                lp.solverModel.setOptionValue("output_flag", True)
                lp.solverModel.setOptionValue("log_to_console", False)
            # HiGHS refuses a thread count other than the one its process-wide scheduler was
            # started with (e.g. by an earlier solve with threads=1): start a fresh scheduler.
            highspy.Highs.resetGlobalScheduler(True)
            try:
                lp.solverModel.run()
            finally:  # and leave none behind, so later solves may pick their own thread count
                highspy.Highs.resetGlobalScheduler(True)

    return _HiGHSWarm


def _cbc(**options: Any) -> Any:
    """CBC through pulp: a ``cbc`` on the PATH (``COIN_CMD``, e.g. ``pip install pulp[cbc]``), else
    the binary bundled with pulp < 4 (``PULP_CBC_CMD``, deprecated there and gone in PuLP 4.0)."""
    coin = pulp.COIN_CMD(**options)
    if coin.available():
        return coin
    bundled = getattr(pulp, "PULP_CBC_CMD", None)
    if bundled is None:
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # handled: COIN_CMD is preferred above
        return bundled(**options)


def solver_available(name: str) -> bool:
    if name == "highs":
        return pulp.HiGHS().available()
    if name == "cbc":
        return bool(_cbc(msg=False).available())
    if name == "gurobi":
        try:
            return bool(pulp.GUROBI(msg=False).available())
        except Exception:  # noqa: BLE001 - a missing or unlicensed gurobipy
            return False
    return False


def solver_label(name: str) -> str:
    if name == "highs":
        return f"highs {getattr(highspy, '__version__', '')}".strip() + " (pulp)"
    return f"{name} (pulp {pulp.__version__})"


def solve_pulp(
    prob: pulp.LpProblem,
    *,
    solver: str = "highs",
    time_limit_s: float | None = None,
    threads: int = 1,
    gap_rel: float | None = None,
    initial: dict[str, float] | None = None,
    on_progress: ProgressFn | None = None,
    stop_at: float | None = None,
) -> SolveOutcome:
    """Solve a pulp model with HiGHS (default), CBC or Gurobi; never needs a licence.

    ``initial`` maps variable names to a warm start; ``stop_at`` interrupts HiGHS as soon as
    the incumbent reaches that objective. ``on_progress`` gets incumbent/bound reports
    (HiGHS only; the others report once at the end).
    """
    if solver not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r} (choose from {', '.join(SOLVERS)})", field="--solver")
    if not solver_available(solver):
        raise ConfigError(f"solver {solver!r} is not installed or not usable here", field="--solver")
    maximize = prob.sense == pulp.LpMaximize
    sign = -1.0 if maximize else 1.0
    t0 = time.monotonic()
    state: dict[str, Any] = {"stopped": False, "bound": None, "last": 0.0}
    if initial:
        for var in prob.variables():
            if var.name in initial:
                var.setInitialValue(initial[var.name])
    if solver == "highs":
        quiet_banner(highspy.Highs)
        log_kind = int(highspy.cb.HighsCallbackType.kCallbackLogging)

        def callback(kind: int, message: str, out: Any, inp: Any, user: Any) -> None:
            if int(kind) == log_kind:
                log_solver_line(message)
                return
            inc = out.mip_primal_bound
            bnd = out.mip_dual_bound
            inc_v = None if not math.isfinite(inc) or abs(inc) >= 1e30 else sign * inc
            bnd_v = None if not math.isfinite(bnd) or abs(bnd) >= 1e30 else sign * bnd
            if bnd_v is not None:
                state["bound"] = bnd_v
            now = time.monotonic() - t0
            if on_progress is not None and (now - state["last"] >= 0.5 or kind != int(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)):
                state["last"] = now
                on_progress(Progress(inc_v, bnd_v, now))
            if stop_at is not None and inc_v is not None and (inc_v >= stop_at - 1e-6 if maximize else inc_v <= stop_at + 1e-6):
                state["stopped"] = True
                inp.user_interrupt = True

        kinds = [highspy.cb.HighsCallbackType.kCallbackMipInterrupt, highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution]
        if solver_log_wanted():
            kinds.append(highspy.cb.HighsCallbackType.kCallbackLogging)
        cls = _highs_solver_class()
        s = cls(
            msg=False,
            timeLimit=time_limit_s,
            threads=threads,
            gapRel=gap_rel,
            initial=initial,
            callbackTuple=(callback, None),
            callbacksToActivate=kinds,
        )
    elif solver == "cbc":
        s = _cbc(msg=False, timeLimit=time_limit_s, threads=threads, gapRel=gap_rel, warmStart=bool(initial))
    else:
        s = pulp.GUROBI(msg=False, timeLimit=time_limit_s, threads=threads, gapRel=gap_rel, warmStart=bool(initial))
    prob.solve(s)
    wall = time.monotonic() - t0
    obj = pulp.value(prob.objective)
    sol_status = prob.sol_status
    has_solution = sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) and obj is not None
    if state["stopped"]:
        status = "reached_target"
    elif sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif prob.status == pulp.LpStatusInfeasible:
        status = "infeasible"
    elif has_solution:
        status = "time_limit"
    else:
        status = "no_solution"
    bound = state["bound"]
    if status == "optimal" and obj is not None:
        bound = obj
    if on_progress is not None:
        on_progress(Progress(float(obj) if has_solution else None, bound, wall, status))
    return SolveOutcome(
        status=status,
        objective=float(obj) if has_solution else None,
        bound=bound,
        solver=solver_label(solver),
        wall_s=wall,
        stopped_early=state["stopped"],
    )
