"""Chi-square statistics and thresholds for the speculative sampling tests (no scipy)."""

from __future__ import annotations

import math

import numpy as np

# Standard normal quantile at 1 - 1e-4: a correct sampler fails a test once in 10,000
# seed sets, and the seeds are fixed.
Z_1E4 = 3.719


def chi2_threshold(df: int, z: float = Z_1E4) -> float:
    """The chi-square quantile for `df` degrees of freedom at the normal quantile `z`
    (Wilson-Hilferty; within a few percent of the exact value for df >= 3)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray,
                    min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, bins with fewer than
    `min_expected` expected merged into one; returns (statistic, degrees of freedom)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


def homogeneity(a: np.ndarray, b: np.ndarray, min_count: float = 10.0) -> tuple[float, int]:
    """Two-sample statistic for counts `a` and `b` over the same bins with the same
    totals; sparse bins merged. Returns (statistic, degrees of freedom)."""
    assert a.sum() == b.sum()
    big = (a + b) >= min_count
    a = np.append(a[big], a[~big].sum())
    b = np.append(b[big], b[~big].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    return float(((a - b) ** 2 / (a + b)).sum()), int(keep.sum() - 1)
