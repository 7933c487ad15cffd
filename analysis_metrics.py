"""Metrics of the analysis, JSON-able (python floats and lists, None where undefined): bias,
coverage, width and resolution of HPD summaries, classification, effective sample sizes and
sliced Wasserstein distances.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

import hpd

__all__ = [
    "MAX_FLAGGED_SHARE",
    "bias_metrics",
    "classification_metrics",
    "coverage_metrics",
    "effective_sample_size",
    "effective_sizes",
    "finite_or_none",
    "level_key",
    "randomised_inside",
    "resolution_flags",
    "resolution_metrics",
    "sliced_wasserstein",
    "wasserstein_1d",
    "width_metrics",
    "wilson_interval",
]

Summaries = Mapping[str, Any]  # HPD summaries per case, as numpy arrays (see hpd.hld_summaries)

# ---------------------------------------------------------------------------
# Metrics (JSON-able: python floats/lists, None where undefined)
# ---------------------------------------------------------------------------


def finite_or_none(value: Any) -> float | None:
    """A python float, or None when undefined (NaN/inf or no data)."""
    value = float(value)
    return value if math.isfinite(value) else None


def _mean(values):
    """Mean as a JSON number, None for an empty array."""
    values = np.asarray(values, dtype=np.float64)
    return finite_or_none(values.mean()) if values.size else None


def level_key(level: float) -> str:
    """The JSON key of a level, e.g. '0.68'."""
    return f"{float(level):g}"


def bias_metrics(modes: Any, truths: Any, names: Sequence[str]) -> dict[str, Any]:
    """Per-axis signed/absolute mean error and RMSE of the modes, and overall RMSE."""
    error = np.asarray(modes, dtype=np.float64) - np.asarray(truths, dtype=np.float64)
    per_axis = {}
    for j, name in enumerate(names):
        e = error[:, j]
        per_axis[name] = {
            "signed": _mean(e),
            "absolute": _mean(np.abs(e)),
            "rmse": finite_or_none(math.sqrt(e.dot(e) / e.size)) if e.size else None,
        }
    rmse = finite_or_none(math.sqrt((error**2).mean())) if error.size else None
    return {"cases": int(error.shape[0]), "per_axis": per_axis, "rmse": rmse}


def wilson_interval(successes: float, trials: int, z: float = 1.959963984540054) -> list[float] | None:
    """The 95% Wilson score interval [lo, hi] of a binomial proportion, None without trials."""
    if trials == 0:
        return None
    share, spread = successes / trials, z * z / trials
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def randomised_inside(credibility: Any, credibility_upper: Any, level: float) -> np.ndarray:
    """Per case, the probability that the randomised HPD region of `level` holds the truth.

    The truth's credibility is spread uniformly over [credibility, credibility_upper] (the
    mass denser than the truth, and that mass with the truth's ties added): a truth on the
    region's boundary level set is inside with probability (α − mass strictly above) / (mass
    at that level). Without ties it is 1 below α and 0 from α on, as `covered`. For the exact
    likelihood the mean over cases is nominal on a lattice too, where the smallest region
    reaching α holds more than α.
    """
    low = np.asarray(credibility, dtype=np.float64)
    high = np.maximum(np.asarray(credibility_upper, dtype=np.float64), low)
    tie = high - low
    spread = np.divide(level - low, tie, out=np.zeros_like(low), where=tie > 0)
    return np.where(tie > 0, np.clip(spread, 0.0, 1.0), (low < level).astype(np.float64))


def coverage_metrics(
    summaries: Summaries, truths: Any, levels: Sequence[float], names: Sequence[str]
) -> dict[str, Any]:
    """Per level: the fraction of truths inside the projected bounds per axis (and their mean) and
    inside the joint region, with the case count and 95% Wilson intervals of each fraction; and
    `lattice`, the randomised joint coverage (see randomised_inside), nominal for an exact
    likelihood on lattice priors too, with `lattice_interval` (Wilson, as if of `cases` draws).
    Without the credibility fields `lattice` is `joint`."""
    truths = np.asarray(truths, dtype=np.float64)
    cases = int(truths.shape[0])
    randomised = "credibility" in summaries and "credibility_upper" in summaries
    result = {}
    for i, level in enumerate(hpd.check_levels(levels)):
        inside = (summaries["lower"][:, i] <= truths) & (truths <= summaries["upper"][:, i])
        covered = np.asarray(summaries["covered"][:, i])
        lattice = (
            randomised_inside(summaries["credibility"], summaries["credibility_upper"], level)
            if randomised
            else covered.astype(np.float64)
        )
        result[level_key(level)] = {
            "nominal": float(level),
            "cases": cases,
            "per_axis": {name: _mean(inside[:, j]) for j, name in enumerate(names)},
            "per_axis_interval": {
                name: wilson_interval(int(inside[:, j].sum()), cases) for j, name in enumerate(names)
            },
            "mean": _mean(inside.mean(axis=1)) if inside.size else None,
            "joint": _mean(covered),
            "interval": wilson_interval(int(covered.sum()), cases),
            "lattice": _mean(lattice),
            "lattice_interval": wilson_interval(float(lattice.sum()), cases),
        }
    return result


def width_metrics(summaries: Summaries, levels: Sequence[float], names: Sequence[str]) -> dict[str, Any]:
    """Mean projected width (upper − lower) per level, per axis and averaged over axes."""
    result = {}
    for i, level in enumerate(hpd.check_levels(levels)):
        width = summaries["upper"][:, i] - summaries["lower"][:, i]
        result[level_key(level)] = {
            "per_axis": {name: _mean(width[:, j]) for j, name in enumerate(names)},
            "mean": _mean(width.mean(axis=1)) if width.size else None,
        }
    return result


MIN_REGION_ESS = 100  # effective points a widest region needs before its mass and bounds are trusted
MAX_EDGE_MASS = 0.01  # mass allowed near the edge of a refined box
MAX_FLAGGED_SHARE = 0.01  # a larger share of flagged cases raises the warning


def resolution_flags(summaries: Summaries, design: str) -> dict[str, np.ndarray]:
    """Per case: too few effective points in the widest region, mass at a refined box's edge, or a
    refined density that disagrees with the passes that placed it (booleans, one per case)."""
    region_ess = np.asarray(summaries["region_ess"], dtype=np.float64)
    missing = np.full(region_ess.shape, np.nan)
    edge = np.asarray(summaries.get("edge_mass", missing), dtype=np.float64)
    disagreement = np.asarray(summaries.get("disagreement", missing), dtype=np.float64)
    return {
        # An enumerated lattice is the support itself: nothing is left to resolve.
        "few_effective_points": (region_ess < MIN_REGION_ESS) & (design != "enumerate"),
        "edge_mass": np.nan_to_num(edge, nan=0.0) > MAX_EDGE_MASS,
        "disagreement": np.nan_to_num(disagreement, nan=0.0) > 1.0,
    }


def _flag_problem(flagged, cases, levels):
    """The warning text for flagged cases, or None when few enough are flagged."""
    if not cases or flagged["any"] <= MAX_FLAGGED_SHARE * cases:
        return None
    return (
        f"{flagged['any']} of {cases} cases are under-resolved ({flagged['few_effective_points']} with fewer "
        f"than {MIN_REGION_ESS} effective points in the {max(levels):g} region, {flagged['edge_mass']} with "
        f"mass at the edge of the refined box, {flagged['disagreement']} where the refined density "
        "disagrees with the passes that placed it)"
    )


def resolution_metrics(
    summaries: Summaries, candidate_count: int, levels: Sequence[float] | np.ndarray, design: str = "sobol"
) -> dict[str, Any]:
    """Candidate count, ESS spread, attained mass per level, counts of under-resolved cases, a warning."""
    levels = hpd.check_levels(levels)
    ess = np.asarray(summaries["ess"], dtype=np.float64)
    region_ess = np.asarray(summaries["region_ess"], dtype=np.float64)
    median = finite_or_none(np.median(ess)) if ess.size else None
    attained, problems = {}, []
    for i, level in enumerate(levels):
        mass = _mean(summaries["mass"][:, i])
        attained[level_key(level)] = mass
        if mass is not None and mass > level + 0.05:
            problems.append(f"mean attained mass {mass:.3f} exceeds level {level:g} by more than 0.05")
    if median is not None and median < 10:
        problems.insert(0, f"median ESS {median:.1f} is below 10")
    flags = resolution_flags(summaries, design)
    flagged = {name: int(values.sum()) for name, values in flags.items()}
    flagged["any"] = int(np.logical_or.reduce(list(flags.values())).sum()) if ess.size else 0
    problem = _flag_problem(flagged, int(ess.size), levels)
    if problem:
        problems.append(problem)
    warning = None
    if problems and design != "enumerate":  # an enumerated lattice is exact, however few points carry the mass
        fix = (
            "raise inference.candidates.candidate_count or refinement_stages"
            if design == "adaptive"
            else "set inference.candidates.kind to 'adaptive' or raise candidate_count or candidate_points_per_axis"
        )
        warning = "low candidate resolution: " + "; ".join(problems) + "; " + fix
    return {
        "design": design,
        "candidate_count": int(candidate_count),
        "cases": int(ess.size),
        "ess_min": finite_or_none(ess.min()) if ess.size else None,
        "ess_median": median,
        "ess_median_fraction": finite_or_none(median / candidate_count)
        if median is not None and candidate_count
        else None,
        "region_ess_min": finite_or_none(region_ess.min()) if region_ess.size else None,
        "region_ess_median": finite_or_none(np.median(region_ess)) if region_ess.size else None,
        "attained_mass": attained,
        "flagged": flagged,
        "warning": warning,
    }


# ---------------------------------------------------------------- classification


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of `values`, ties sharing their average rank."""
    _, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    return (ends - (counts.to(torch.float64) - 1) / 2)[inverse]


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """BCE (from logits), accuracy at logit 0 and AUC (None when one class is absent)."""
    # On the host in float64: exact enough for ranks, and free of device determinism limits.
    logits = logits.detach().reshape(-1).to("cpu", torch.float64)
    labels = labels.detach().reshape(-1).to("cpu", torch.float64)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    positive = labels > 0.5
    accuracy = ((logits > 0) == positive).to(torch.float64).mean().item()
    n_pos = int(positive.sum().item())
    n_neg = positive.numel() - n_pos
    auc = None
    if n_pos and n_neg:
        # Mann-Whitney: U = sum of positive ranks minus its minimum possible value.
        rank_sum = _average_ranks(logits)[positive].sum().item()
        auc = (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    return {"bce": bce, "accuracy": accuracy, "auc": auc}


# ---------------------------------------------------------------- sample-based checks


def effective_sizes(log_weights: torch.Tensor) -> torch.Tensor:
    """Kish's effective sample size (Σw)²/Σw² of weights given as logs, over the last axis."""
    return torch.exp(2 * torch.logsumexp(log_weights, -1) - torch.logsumexp(2 * log_weights, -1))


def effective_sample_size(log_weights: Any) -> float | None:
    """The effective sample size of one set of weights given as logs, as a JSON number."""
    return finite_or_none(effective_sizes(torch.as_tensor(log_weights, dtype=torch.float64)))


def wasserstein_1d(a: torch.Tensor, a_weights: torch.Tensor, b: torch.Tensor, b_weights: torch.Tensor) -> float:
    """W1 between two weighted empirical distributions on the line: ∫|F_a − F_b| dx."""
    values = torch.cat([a, b])
    order = torch.argsort(values)
    masses = torch.cat([a_weights / a_weights.sum(), -b_weights / b_weights.sum()])[order]
    gaps = torch.diff(values[order])
    return float((torch.cumsum(masses, 0)[:-1].abs() * gaps).sum())


def sliced_wasserstein(a: Any, b: Any, b_log_weights: Any = None, projections: int = 64, seed: int = 0) -> float:
    """Mean W1 over random 1-D projections between sample `a` and (weighted) sample `b`.

    Coordinates are standardised by the pooled spread first, so every column counts
    alike whatever its units.
    """
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    scale = torch.cat([a, b]).std(0).clamp_min(1e-12)
    a, b = a / scale, b / scale
    if b_log_weights is None:
        b_weights = torch.ones(b.shape[0], dtype=torch.float64)
    else:
        b_log_weights = torch.as_tensor(b_log_weights, dtype=torch.float64)
        b_weights = torch.exp(b_log_weights - b_log_weights.max())
    a_weights = torch.ones(a.shape[0], dtype=torch.float64)
    directions = torch.randn(
        projections, a.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    directions /= directions.norm(dim=1, keepdim=True)
    return sum(wasserstein_1d(a @ d, a_weights, b @ d, b_weights) for d in directions) / projections
