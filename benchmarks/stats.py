"""How close predictions are to measurements: the statistics the fidelity benchmarks report.

- `median_error`: the median absolute relative error, |predicted - measured| / measured;
- `spearman`: Spearman's rank correlation (do the predictions rank as the measurements do?);
- `order_agreement`: the same question over the pairs that measurement noise can order;
- `quartiles`: the first and third quartile of a sample (its interquartile range).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np


def median_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The median over pairs of |predicted - measured| / measured."""
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    return statistics.median(errors)


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing the mean of their ranks (as Spearman's rho needs)."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        r[tied] = r[tied].mean()
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def order_agreement(predicted: Sequence[float], measured: Sequence[float], margin: float) -> str:
    """Of the pairs of plans whose measured times differ by more than ``margin`` (relative to
    the faster), how many the prediction orders the same way: rank correlation without the
    pairs that measurement noise cannot order either."""
    agree = total = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            fast, slow = sorted((measured[i], measured[j]))
            if slow <= fast * (1 + margin):
                continue
            total += 1
            agree += (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0
    return f"{agree} of {total}"


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and the third quartile of ``values`` (at least two)."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3
