"""The 97.5% quantiles of the normal and of Student's t (two-sided 95% intervals), shared by every stopping
rule and interval: the sweep's repeats (sweeping/stopping.py), qualify's pooled spreads
(qualifying/spreads.py) and a serve load's p99 over its windows (serving/traffic.py)."""

from __future__ import annotations

Z95 = 1.959964  # the normal distribution's 97.5% quantile: a 95% interval is +-Z95 standard errors

# Two-sided 95% quantiles of Student's t, by degrees of freedom 1..30; beyond, the normal's 1.96 plus the
# first term of the Cornish-Fisher expansion (within 0.1% of the exact value from 30 on).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with `dof` degrees of freedom (dof >= 1)."""
    if dof < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    if dof <= len(_T975):
        return _T975[dof - 1]
    return Z95 + (Z95**3 + Z95) / (4 * dof)
