"""The quantiles of the normal and of Student's t behind every interval and test (scipy's), shared by every
stopping rule and interval: the sweep's repeats (sweeping/stopping.py), its race and equivalence tests
(sweeping/ranking.py, sweeping/equivalence.py), qualify's pooled spreads (qualifying/spreads.py) and a serve
load's p99 over its windows (serving/traffic.py). scipy is imported on first use, and only its special
functions (scipy.stats would add about 1.5 s to every command's start)."""

from __future__ import annotations

from functools import cache

# The normal distribution's 97.5% quantile (scipy.special.ndtri(0.975), held by a test): a 95% interval is
# +-Z95 standard errors.
Z95 = 1.959963984540054


@cache
def t_quantile(share: float, dof: int) -> float:
    """The `share` quantile of Student's t with `dof` degrees of freedom (dof >= 1)."""
    if dof < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    from scipy.special import stdtrit

    return float(stdtrit(dof, share))


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with `dof` degrees of freedom (dof >= 1): a two-sided 95% interval."""
    return t_quantile(0.975, dof)


def t95(dof: int) -> float:
    """The 95% quantile of Student's t (dof >= 1): each one-sided test of an equivalence at the 5% level."""
    return t_quantile(0.95, dof)
