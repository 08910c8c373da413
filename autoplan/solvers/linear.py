"""A mixed-integer linear program held as plain lists, and its solve: by HiGHS (highspy, given
the whole matrix at once) or by CBC (through pulp, which ships it).

The intra-op ILP of a real model's 2-D mesh has about 100,000 variables. Built as pulp
expressions, one Python object per variable and term, building it and handing it to HiGHS
took as long as HiGHS's own solve (benchmarks/results/plan_real.md's "solve" phase); as lists
of numbers it is handed over in one call.

Columns are handed to a solver sorted by name: the order decides which of several equally
cheap plans a solver returns, so a name, not the order of building, fixes it (as pulp, which
sorts its variables by name, did).
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pulp

INF = math.inf
# a product that stands for the constant 1 (a certain choice), in a row's terms
ONE = -1

Term = tuple[int, float]  # a column (or `ONE`) and its coefficient


@dataclass
class LinearProgram:
    """Minimize ``sum cost[c] x[c]`` subject to ``lower <= x <= upper`` (integral where
    ``integer``) and, for each row, ``row_lower <= sum coefficient x[column] <= row_upper``."""

    names: list[str] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_terms: list[dict[int, float]] = field(default_factory=list)

    @property
    def num_columns(self) -> int:
        return len(self.names)

    @property
    def num_rows(self) -> int:
        return len(self.row_names)

    def column(self, name: str, upper: float = 1.0, integer: bool = False) -> int:
        """A new column in [0, ``upper``] (INF: unbounded above); its index."""
        self.names.append(name)
        self.lower.append(0.0)
        self.upper.append(upper)
        self.integer.append(integer)
        self.cost.append(0.0)
        return len(self.names) - 1

    def row(
        self, name: str, terms: Iterable[Term], lower: float = -INF, upper: float = INF
    ) -> None:
        """``lower <= sum terms <= upper``; a term of `ONE` moves to the bounds, terms of one
        column add up, zero coefficients are dropped."""
        summed: dict[int, float] = {}
        for column, coefficient in terms:
            if column == ONE:
                lower, upper = lower - coefficient, upper - coefficient
            else:
                summed[column] = summed.get(column, 0.0) + coefficient
        self.row_names.append(name)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_terms.append({c: x for c, x in summed.items() if x != 0})


@dataclass(frozen=True)
class LinearSolution:
    """What a solve ends with: "optimal", "stopped" (at the time limit, with a plan),
    "infeasible" or "none" (stopped with no plan); the columns' values (empty without a
    plan); and the relative gap of a stopped solve, where the solver says it."""

    status: str
    values: tuple[float, ...]
    gap: float | None = None


def solve_with_highs(
    program: LinearProgram,
    time_limit_s: float,
    gap_rel: float,
    log: Callable[[str], None] | None,
) -> LinearSolution:
    """Solve ``program`` with HiGHS, one thread; its log lines to ``log`` (else none)."""
    import highspy

    order = sorted(range(program.num_columns), key=program.names.__getitem__)
    position = np.empty(program.num_columns, dtype=np.int64)
    position[order] = np.arange(program.num_columns)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", log is not None)
    if log is not None:
        highs.setOptionValue("log_to_console", False)
        highs.setCallback(lambda kind, message, *_: log(message), None)
        highs.startCallback(highspy.cb.HighsCallbackType.kCallbackLogging)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("mip_rel_gap", gap_rel)
    highs.setOptionValue("time_limit", float(time_limit_s))
    _pass_model(highs, program, order, position)
    highs.run()
    return _read_highs(highs, order)


def _pass_model(highs: Any, program: LinearProgram, order: list[int], position: Any) -> None:
    import highspy

    inf = highspy.kHighsInf
    n = program.num_columns
    costs = np.asarray(program.cost, dtype=np.float64)[order]
    lower = np.asarray(program.lower, dtype=np.float64)[order]
    upper = np.minimum(np.asarray(program.upper, dtype=np.float64)[order], inf)
    highs.addVars(n, lower, upper)
    highs.changeColsCost(n, np.arange(n, dtype=np.int32), costs)
    integral = np.flatnonzero(np.asarray(program.integer, dtype=bool)[order]).astype(np.int32)
    if len(integral):
        kinds = np.full(len(integral), highspy.HighsVarType.kInteger)
        highs.changeColsIntegrality(len(integral), integral, kinds)
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []
    for terms in program.row_terms:
        starts.append(len(index))
        index.extend(terms)
        value.extend(terms.values())
    row_lower = np.maximum(np.asarray(program.row_lower, dtype=np.float64), -inf)
    row_upper = np.minimum(np.asarray(program.row_upper, dtype=np.float64), inf)
    highs.addRows(
        program.num_rows,
        row_lower,
        row_upper,
        len(index),
        np.asarray(starts, dtype=np.int32),
        position[np.asarray(index, dtype=np.int64)].astype(np.int32),
        np.asarray(value, dtype=np.float64),
    )


def _read_highs(highs: Any, order: list[int]) -> LinearSolution:
    import highspy

    status = highs.getModelStatus()
    statuses = highspy.HighsModelStatus
    if status == statuses.kOptimal:
        kind = "optimal"
    elif status in (statuses.kInfeasible, statuses.kUnboundedOrInfeasible):
        return LinearSolution("infeasible", ())
    elif status in (statuses.kTimeLimit, statuses.kInterrupt) and math.isfinite(
        highs.getInfo().objective_function_value
    ):
        kind = "stopped"
    else:
        return LinearSolution("none", ())
    sorted_values = highs.getSolution().col_value
    values = [0.0] * len(order)
    for at, column in enumerate(order):
        values[column] = sorted_values[at]
    gap = float(highs.getInfo().mip_gap) if kind == "stopped" else None
    return LinearSolution(kind, tuple(values), gap if gap is None or gap >= 0 else None)


def solve_with_cbc(
    program: LinearProgram, time_limit_s: float, gap_rel: float, log: Callable[[str], None] | None
) -> LinearSolution:
    """Solve ``program`` with pulp's bundled CBC, one thread; its log to ``log`` (else none).
    CBC does not say the gap it stopped at."""
    model = pulp.LpProblem("intra_op", pulp.LpMinimize)
    columns = [
        model.add_variable(
            name,
            lower,
            None if math.isinf(upper) else upper,
            pulp.LpInteger if integer else pulp.LpContinuous,
        )
        for name, lower, upper, integer in zip(
            program.names, program.lower, program.upper, program.integer, strict=True
        )
    ]
    model += pulp.LpAffineExpression([(columns[c], x) for c, x in enumerate(program.cost) if x])
    for name, low, high, terms in zip(
        program.row_names, program.row_lower, program.row_upper, program.row_terms, strict=True
    ):
        expression = pulp.LpAffineExpression([(columns[c], x) for c, x in terms.items()])
        if low == high:
            model += expression == low, name
            continue
        if math.isfinite(low):
            model += expression >= low, name if math.isinf(high) else f"{name}_low"
        if math.isfinite(high):
            model += expression <= high, name
    with tempfile.TemporaryDirectory() as folder:
        log_path = Path(folder) / "cbc.log"
        # PuLP >= 3.3 deprecates its bundled CBC (PULP_CBC_CMD); it is still the one CBC that
        # ships with pulp, so keep using it without the warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cbc = pulp.PULP_CBC_CMD(
                msg=False,
                timeLimit=time_limit_s,
                threads=1,
                gapRel=gap_rel,
                logPath=str(log_path) if log is not None else None,
            )
        model.solve(cbc)
        if log is not None:
            log(log_path.read_text())
    if model.sol_status == pulp.LpSolutionInfeasible:
        return LinearSolution("infeasible", ())
    if model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return LinearSolution("none", ())
    kind = "optimal" if model.sol_status == pulp.LpSolutionOptimal else "stopped"
    return LinearSolution(kind, tuple(x.varValue or 0.0 for x in columns))
