"""Highest-density (HPD) summaries of scored cases: regions, their projected bounds and masses, the
mode, effective sizes and the truth's credibility (hld_summaries, weighted_summary).

Generic on purpose: it works on scores, log measures and points, and knows no study.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

import designs

__all__ = [
    "check_levels",
    "check_scores",
    "hld_summaries",
    "host_summary",
    "point_columns",
    "region_bounds",
    "summarise_block",
    "weighted_summary",
]

Summary = dict[str, torch.Tensor]  # a block's summaries, one tensor per field
Ranking = tuple[torch.Tensor, torch.Tensor]  # density order (B, K) and the levels' region sizes (B, L)
Levels = Sequence[float] | np.ndarray  # enclosed masses in (0, 1]
Ranked = tuple[Summary, Ranking]  # another target's summary and ranking (weighted_summary)

# Cases summarised at once: bounds the (cases, K) work arrays of hld_summaries.
SUMMARY_CELLS = 1 << 22


# ---------------------------------------------------------------------------
# Highest-density summaries
# ---------------------------------------------------------------------------


def check_levels(levels: Levels) -> np.ndarray:
    """Levels as a float64 array, each in (0, 1]."""
    levels = np.asarray(list(levels), dtype=np.float64)
    if levels.size == 0 or not ((levels > 0) & (levels <= 1)).all():
        raise ValueError(f"levels must be enclosed masses in (0, 1], got {levels.tolist()}")
    return levels


def check_scores(scores: torch.Tensor, truth_scores: torch.Tensor) -> None:
    """Raise naming the first case whose scores are NaN, +inf or all -inf."""
    bad = torch.isnan(scores).any(dim=1) | torch.isposinf(scores).any(dim=1)
    bad |= torch.isneginf(scores).all(dim=1) | torch.isnan(truth_scores) | torch.isposinf(truth_scores)
    if bad.any():
        case = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"case {case}: scores must be finite or -inf, not NaN/+inf, and not all -inf; "
            "check the network output or the likelihood for that case"
        )


def _mass_above(ascending, cumulative, values, side):
    """Per case, the normalised mass of the candidates denser than its value ("left") or as dense
    ("right"); ascending (B, K) holds the candidates' scores, negated, from the densest down."""
    count = torch.searchsorted(ascending, -values[:, None], side=side)
    mass = torch.gather(cumulative, 1, (count - 1).clamp(min=0))[:, 0]
    return torch.where(count[:, 0] > 0, mass, torch.zeros_like(mass))


def region_bounds(columns: torch.Tensor, scores: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per case and level, the bounds (B, L, p) of the level's region {scores >= threshold}
    (+inf/−inf where it holds no point); columns (B, p, K) holds each coordinate of the points
    as a contiguous row.

    The regions are nested, so each point falls in one bin, the count of thresholds it does
    not reach (a NaN score reaches none); the bounds of every bin take one pass
    (scatter_reduce), and a level's region is the union of the bins up to the count of
    thresholds above its own.
    """
    (cases, p, _), levels = columns.shape, threshold.shape[1]
    reached = (scores[:, None, :] >= threshold[:, :, None]).sum(dim=1)
    bins = (levels - reached)[:, None, :].expand(-1, p, -1)
    inner = (threshold[:, None, :] > threshold[:, :, None]).sum(dim=2)[:, None, :].expand(-1, p, -1)
    bounds = []
    for reduce, start, running in (("amin", math.inf, torch.cummin), ("amax", -math.inf, torch.cummax)):
        per_bin = columns.new_full((cases, p, levels + 1), start).scatter_reduce_(2, bins, columns, reduce)
        bounds.append(torch.gather(running(per_bin, dim=2).values, 2, inner).transpose(1, 2))
    return tuple(bounds)


def point_columns(points: torch.Tensor) -> torch.Tensor:
    """Each case's points (B, n, p) as columns (B, p, n), each coordinate a contiguous row: the
    transpose itself when its rows are contiguous already (points held as columns), else a copy."""
    columns = points.transpose(1, 2)
    return columns if columns.stride(2) == 1 else columns.contiguous()


def _density_order(scores, order=None):
    """Each case's candidates from the densest down, (B, K): `order`, another target's, where it
    orders this case's scores too (a score shifted by a constant log prior keeps its order),
    else a sort.

    On the CPU numpy's vectorised quicksort is about three times torch's stable sort;
    the order it gives ties (its own, deterministic) changes no summary but for the
    rounding of sums over them. Elsewhere torch sorts on the device.
    """
    if order is not None:
        ranked = torch.gather(scores, 1, order)
        unsorted = (ranked[:, 1:] > ranked[:, :-1]).any(dim=1) | torch.isnan(ranked).any(dim=1)
        if not bool(unsorted.any()):
            return order
        order = order.clone()
        order[unsorted] = _density_order(scores[unsorted])
        return order
    if scores.device.type == "cpu":
        return torch.from_numpy(np.argsort(-scores.numpy(), axis=1))
    return torch.argsort(scores, dim=1, descending=True, stable=True)


def summarise_block(
    scores: torch.Tensor, log_measure: torch.Tensor, points: torch.Tensor, truth_scores: torch.Tensor, levels: Levels
) -> Summary:
    """HPD summaries of a block of cases as tensors on the scores' device (see hld_summaries).

    scores (B, K); log_measure (K,) and points (K, p) shared by the cases, or each
    case's own, (B, K) and (B, K, p).
    """
    return weighted_summary(scores, log_measure, points, truth_scores, levels)[0]


def _widest_region_ess(running, sorted_q, widest):
    """Kish ESS (B,) of the points inside the widest region, how well it is resolved: running holds the
    cumulative weights in density order and widest (B, 1) the region's last index. Squares sorted_q in place."""
    return (
        torch.gather(running, 1, widest) ** 2 / torch.gather(torch.cumsum(sorted_q.mul_(sorted_q), dim=1), 1, widest)
    )[:, 0]


def weighted_summary(
    scores: torch.Tensor,
    log_measure: torch.Tensor,
    points: torch.Tensor,
    truth_scores: torch.Tensor,
    levels: Levels,
    other: Ranked | None = None,
) -> tuple[Summary, torch.Tensor, Ranking]:
    """summarise_block's summaries, the candidates' normalised weights q (B, K) and their ranking: density
    order (B, K) and the levels' region sizes (B, L). `other`, another target's summary and ranking on the
    same points: its order is used where it orders these scores too, its bounds where every region agrees."""
    n, count = scores.shape
    # Each coordinate as a contiguous row (B, p, K), the layout the bounds' reductions run along.
    columns = points.T.contiguous().expand(n, -1, -1) if points.dim() == 2 else point_columns(points)
    points = columns.transpose(1, 2)
    log_mass = scores + log_measure
    log_normalizer = torch.logsumexp(log_mass, dim=1)
    q = log_mass.sub_(log_normalizer[:, None]).exp_()
    ess = 1.0 / (q * q).sum(dim=1)
    order = _density_order(scores, None if other is None else other[1][0])
    sorted_scores = torch.gather(scores, 1, order)
    sorted_q = torch.gather(q, 1, order)
    running = torch.cumsum(sorted_q, dim=1)
    cumulative = running / running[:, -1:]  # exact 1 at the end, so level 1 is reachable
    level_t = torch.as_tensor(levels, dtype=torch.float64, device=scores.device)
    reach = torch.searchsorted(cumulative, level_t.expand(n, -1).contiguous(), side="left")
    threshold = torch.gather(sorted_scores, 1, reach.clamp(max=count - 1))
    # Every tie at the cutoff joins: the region is the prefix of scores >= threshold.
    ascending = sorted_scores.neg()  # for searchsorted, which looks up ascending rows
    size = torch.searchsorted(ascending, -threshold, side="right")
    last = size - 1
    mass = torch.gather(cumulative, 1, last)
    region_ess = _widest_region_ess(running, sorted_q, last[:, int(np.argmax(levels))][:, None])
    # The truth's credibility: the mass of the candidates denser than the truth. The truth is
    # in the region of level α exactly when its credibility is below α (as `covered` says).
    # With its ties (such as its own lattice point) the mass reaches credibility_upper.
    credibility = _mass_above(ascending, cumulative, truth_scores, "left")
    credibility_upper = _mass_above(ascending, cumulative, truth_scores, "right")
    lower, upper = _bounds(columns, scores, threshold, (order, size), other)
    summary = {
        "lower": lower,
        "upper": upper,
        "mass": mass,
        "threshold": threshold,
        "covered": truth_scores[:, None] >= threshold,
        "mode": points[torch.arange(n, device=scores.device), scores.argmax(dim=1)],  # the first among ties
        "ess": ess,
        "log_normalizer": log_normalizer,
        "region_ess": region_ess,
        "credibility": credibility,
        "credibility_upper": credibility_upper,
    }
    return summary, q, (order, size)


def _bounds(columns, scores, threshold, ranking, other):
    """region_bounds, or those of another target (its summary and ranking) where every region is the
    same prefix of one density order: the same points."""
    if other is not None and ranking[0] is other[1][0] and torch.equal(ranking[1], other[1][1]):
        return other[0]["lower"], other[0]["upper"]
    return region_bounds(columns, scores, threshold)


def host_summary(summary: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A block's summaries as numpy arrays on the host."""
    return {key: value.cpu().numpy() for key, value in summary.items()}


def hld_summaries(
    scores: Any, log_measure: Any, points: Any, truth_scores: Any, levels: Levels
) -> dict[str, np.ndarray]:
    """Highest-density summaries per case as a dict of numpy arrays.

    q ∝ exp(score + log_measure). Candidates are ranked by score (density), and the
    region at level α is {score >= t} for the highest t whose region holds mass >= α,
    i.e. the smallest such region, with all ties at t included. Returns lower/upper
    (n, L, p) projected bounds, mass/threshold/covered (n, L), mode (n, p), ess (n,),
    log_normalizer (n,), region_ess (n,), the Kish ESS of the widest level's region,
    credibility (n,), the mass of the candidates denser than the truth, and
    credibility_upper (n,), the mass of those at least as dense (ties with the truth included).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64).cpu()
    if scores.dim() != 2:
        raise ValueError(f"scores must be (cases, candidates), got shape {tuple(scores.shape)}")
    log_measure = designs.as_f64(log_measure)
    points = torch.as_tensor(points, dtype=torch.float64).cpu()
    truth_scores = designs.as_f64(truth_scores)
    if log_measure.numel() != scores.shape[1] or points.shape[0] != scores.shape[1]:
        raise ValueError("scores, log_measure and points disagree on the candidate count")
    if truth_scores.numel() != scores.shape[0]:
        raise ValueError("truth_scores needs one value per case")
    levels = check_levels(levels)
    check_scores(scores, truth_scores)
    step = max(1, SUMMARY_CELLS // max(1, scores.shape[1]))
    parts = [
        host_summary(summarise_block(scores[i : i + step], log_measure, points, truth_scores[i : i + step], levels))
        for i in range(0, scores.shape[0], step)
    ]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
