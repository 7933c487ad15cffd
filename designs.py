"""Designs of the analysis: truths, observation ensembles, lattices, candidate designs and the
adaptive design's sizes (adaptive.py refines it, case_blocks.py decides which design a case gets).

Generic on purpose: it works on boxes (low/high tensors), lattice steps and settings dicts,
and knows no study: the study kit (nre_analysis.py) calls it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "CANDIDATE_KINDS",
    "PROBE_RADII",
    "PROBE_REFINE",
    "adaptive_sizes",
    "as_f64",
    "candidate_count_for",
    "candidate_design",
    "candidate_lattice",
    "check_box",
    "lattice_size",
    "lattice_support",
    "make_candidates",
    "make_observations",
    "make_truths",
    "merge_duplicates",
    "points_per_case",
    "snap_to_lattice",
    "truth_count",
]

CANDIDATE_KINDS = ("sobol", "grid", "adaptive")
# Bounds of a box or lattice steps as given: a tensor, or one number per parameter.
Values = Any
Steps = Sequence["float | None"]


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def as_f64(values: Values) -> torch.Tensor:
    """Return values as a 1-D CPU float64 tensor."""
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu()


def check_box(low: torch.Tensor, high: torch.Tensor) -> None:
    """Raise when the box is empty, inverted or not finite."""
    if low.shape != high.shape:
        raise ValueError(f"box bounds differ in size: low {tuple(low.shape)} vs high {tuple(high.shape)}")
    if not (torch.isfinite(low).all() and torch.isfinite(high).all() and (high > low).all()):
        raise ValueError("every parameter box needs finite bounds with low < high; fix problem.parameters")


def _sobol(p, count, seed):
    """Draw `count` scrambled Sobol points in the unit cube [0, 1)^p as float64."""
    engine = torch.quasirandom.SobolEngine(p, scramble=True, seed=int(seed))
    return engine.draw(int(count), dtype=torch.float64)


def _cartesian(axes):
    """Cartesian product of 1-D tensors, first axis varying slowest, shape (Π n, p)."""
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=1)


def lattice_size(low: float, high: float, step: float) -> int:
    """Number of lattice points low, low+step, ... that lie in [low, high]."""
    if not step > 0:
        raise ValueError(f"grid_step must be positive, got {step}; fix problem.parameters")
    # Slack of a millionth of a step: 0.2-steps on [0, 10] give 51 points despite rounding.
    return int(math.floor((high - low) / step + 1e-6)) + 1


def lattice_support(low: Values, high: Values, step: Values) -> torch.Tensor:
    """The lattice low + k·step inside [low, high] as a float64 tensor."""
    n = lattice_size(float(low), float(high), float(step))
    return float(low) + torch.arange(n, dtype=torch.float64) * float(step)


def snap_to_lattice(theta: torch.Tensor, low: Values, high: Values, step: Values) -> torch.Tensor:
    """Round each column to its lattice low + k·step, clamped into [low, high]."""
    low, high, step = as_f64(low), as_f64(high), as_f64(step)
    top = torch.tensor(
        [lattice_size(a, b, s) - 1 for a, b, s in zip(low.tolist(), high.tolist(), step.tolist())], dtype=torch.float64
    )
    k = torch.round((theta - low) / step).clamp(min=0)
    k = torch.minimum(k, top)
    return low + k * step


def _first_occurrences(points):
    """Sorted indices of the first occurrence of every distinct row, and the row → group map."""
    array = points.numpy()
    _, first, inverse = np.unique(array, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    # Renumber groups by first appearance so that order is kept.
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return np.sort(first), rank[inverse]


def merge_duplicates(points: torch.Tensor, log_measure: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge exactly equal points, summing their weights in log space; order kept."""
    keep, group = _first_occurrences(points)
    merged = np.full(keep.size, -np.inf)
    np.logaddexp.at(merged, group, log_measure.numpy())
    return points[torch.as_tensor(keep)], torch.from_numpy(merged)


# ---------------------------------------------------------------------------
# Truths and observations
# ---------------------------------------------------------------------------


def _truth_kind(p, settings):
    """Resolve size_adaptive into grid or sobol for dimension p."""
    kind = settings.get("kind", "grid")
    if kind not in ("grid", "sobol", "size_adaptive"):
        raise ValueError(f"truths kind must be grid, sobol or size_adaptive, got {kind!r}")
    if kind == "size_adaptive":
        grid = int(settings.get("truth_points_per_axis", 7)) ** p
        return "grid" if grid <= int(settings.get("max_grid_truths", 4096)) else "sobol"
    return kind


def truth_count(p: int, settings: Mapping[str, Any]) -> int:
    """Number of truth cases, repeats included."""
    kind = _truth_kind(p, settings)
    if kind == "grid":
        count = int(settings.get("truth_points_per_axis", 7)) ** p
    else:
        count = int(settings.get("sobol_truths", 1024)) * 2 ** (p - 1)
    return count * int(settings.get("repeats", 1))


def make_truths(
    low: Values, high: Values, grid_step: Values | None, settings: Mapping[str, Any], seed: int
) -> torch.Tensor:
    """Truth parameters (T, p) float64 inside the margin-shrunk box."""
    low, high = as_f64(low), as_f64(high)
    check_box(low, high)
    p = low.numel()
    margin = float(settings.get("truth_margin_fraction", 0.1))
    if not 0 <= margin < 0.5:
        raise ValueError(f"truth_margin_fraction must be in [0, 0.5), got {margin}")
    repeats = int(settings.get("repeats", 1))
    if repeats < 1:
        raise ValueError(f"truths repeats must be at least 1, got {repeats}")
    inner_low = low + margin * (high - low)
    inner_high = high - margin * (high - low)
    if _truth_kind(p, settings) == "grid":
        n = int(settings.get("truth_points_per_axis", 7))
        if n < 1:
            raise ValueError(f"truth_points_per_axis must be at least 1, got {n}")
        if n == 1:  # one point per axis: the centre, not the lower end
            axes = [((a + b) / 2).reshape(1) for a, b in zip(inner_low, inner_high)]
        else:
            axes = [torch.linspace(float(a), float(b), n, dtype=torch.float64) for a, b in zip(inner_low, inner_high)]
        truths = _cartesian(axes)
    else:
        count = int(settings.get("sobol_truths", 1024)) * 2 ** (p - 1)
        if count < 1:
            raise ValueError(f"sobol_truths must be at least 1, got {settings.get('sobol_truths')}")
        truths = inner_low + _sobol(p, count, seed) * (inner_high - inner_low)
    if settings.get("align_truths_to_grid", True):
        if grid_step is None or as_f64(grid_step).numel() != p:
            raise ValueError(
                "align_truths_to_grid needs one grid_step per parameter; "
                "set the grid_step of each parameter or align_truths_to_grid: false"
            )
        # Snapped truths may coincide; each stays a case of its own, so the workload is as planned.
        truths = snap_to_lattice(truths, low, high, grid_step)
    return truths.repeat_interleave(repeats, dim=0).contiguous()


def make_observations(
    simulate: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
    truths: torch.Tensor,
    observations: int,
    seed: int,
) -> torch.Tensor:
    """Ensembles (N, m, d): m independent simulator draws at each case's truth."""
    m = int(observations)
    if m < 1:
        raise ValueError(f"observations per ensemble must be at least 1, got {m}")
    generator = torch.Generator().manual_seed(int(seed))
    theta = truths.repeat_interleave(m, dim=0)
    x = simulate(theta, generator)
    return x.reshape(truths.shape[0], m, -1)


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


def candidate_lattice(lattice_steps: Steps | None, p: int, settings: Mapping[str, Any]) -> list[float | None]:
    """Per-coordinate lattice step of the candidates: the prior's own with native_grid_prior, else None."""
    continuous: list[float | None] = [None] * p
    steps = list(lattice_steps) if lattice_steps is not None else continuous
    if len(steps) != p:
        raise ValueError(f"lattice_steps has {len(steps)} entries for {p} parameters")
    return steps if settings.get("native_grid_prior", True) else continuous


def _candidate_plan(p, lattice_steps, low, high, settings):
    """Decide 'enumerate', 'grid', 'sobol' or 'adaptive' and the shared design's size before merging.

    An adaptive design shares a coarse Sobol design of coarse_count points; each case
    then refines it on its own, in blocks of cases (see adaptive.refine_block).
    """
    kind = settings.get("kind", "sobol")
    if kind not in CANDIDATE_KINDS:
        raise ValueError(f"candidates kind must be one of {', '.join(CANDIDATE_KINDS)}, got {kind!r}")
    steps = candidate_lattice(lattice_steps, p, settings)
    low, high = as_f64(low), as_f64(high)
    sizes = [lattice_size(float(low[j]), float(high[j]), s) for j, s in enumerate(steps) if s is not None]
    lattice_total = math.prod(sizes)
    if len(sizes) == p and lattice_total <= int(settings.get("max_enumerated", 200000)):
        return "enumerate", lattice_total
    if kind == "grid":
        n = int(settings.get("candidate_points_per_axis", 64))
        if n < 2:
            raise ValueError(f"candidate_points_per_axis must be at least 2, got {n}")
        return "grid", n ** (p - len(sizes)) * lattice_total
    key = "coarse_count" if kind == "adaptive" else "candidate_count"
    count = int(settings.get(key, 256))
    if count < 1:
        raise ValueError(f"{key} must be at least 1, got {count}")
    return kind, count


def candidate_design(
    p: int, lattice_steps: Steps | None, low: Values, high: Values, settings: Mapping[str, Any]
) -> str:
    """The design each case is scored on: 'enumerate', 'grid', 'sobol' or 'adaptive'."""
    return _candidate_plan(p, lattice_steps, low, high, settings)[0]


def candidate_count_for(
    p: int, lattice_steps: Steps | None, low: Values, high: Values, settings: Mapping[str, Any]
) -> int:
    """Size of the shared design (before duplicate merging) without building it."""
    return _candidate_plan(p, lattice_steps, low, high, settings)[1]


def points_per_case(
    p: int, lattice_steps: Steps | None, low: Values, high: Values, settings: Mapping[str, Any], targets: int = 1
) -> int:
    """Points each case is scored on (the truth aside): the shared design, or every adaptive pass."""
    design, count = _candidate_plan(p, lattice_steps, low, high, settings)
    if design == "adaptive":
        return adaptive_sizes(p, settings, targets)["total"]
    return count


def _trapezoid(low, high, n):
    """Points and trapezoid weights of an n-point rule on [low, high]."""
    points = torch.linspace(low, high, n, dtype=torch.float64)
    weights = torch.full((n,), (high - low) / (n - 1), dtype=torch.float64)
    weights[0] /= 2
    weights[-1] /= 2
    return points, weights


def _grid_rule(low, high, steps, n):
    """The product rule: n trapezoid nodes per continuous axis, every lattice point (weight 1) per lattice axis."""
    axes, weights = [], []
    for j, step in enumerate(steps):
        if step is None:
            a, w = _trapezoid(float(low[j]), float(high[j]), n)
        else:
            a = lattice_support(low[j], high[j], step)
            w = torch.ones_like(a)
        axes.append(a)
        weights.append(w.log())
    return _cartesian(axes), _cartesian(weights).sum(dim=1)


def _sobol_rule(low, high, steps, count, seed):
    """The Monte Carlo rule of count Sobol points: lattice indices drawn uniformly, equal weights."""
    unit = _sobol(low.numel(), count, seed)
    columns, log_total = [], 0.0
    for j, step in enumerate(steps):
        if step is None:
            columns.append(low[j] + unit[:, j] * (high[j] - low[j]))
            log_total += math.log(float(high[j] - low[j]))
        else:
            support = lattice_support(low[j], high[j], step)
            index = (unit[:, j] * support.numel()).floor().long().clamp(max=support.numel() - 1)
            columns.append(support[index])
            log_total += math.log(support.numel())
    return torch.stack(columns, dim=1), torch.full((count,), log_total - math.log(count), dtype=torch.float64)


def make_candidates(
    low: Values, high: Values, lattice_steps: Steps | None, settings: Mapping[str, Any], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate points (K, p) and their log quadrature weights (K,), duplicates merged.

    Lattice coordinates (with native_grid_prior) carry counting measure. An all-lattice
    box with at most max_enumerated points is enumerated exactly (weight 1 each). The
    grid kind always uses the full lattice support on lattice axes. The sobol kind with
    lattice axes is a Monte Carlo rule over lattice × continuous: lattice indices are
    drawn uniformly (floor of the Sobol coordinate times the lattice size) and every
    point weighs continuous_volume · Π lattice_sizes / K. The adaptive kind returns its
    coarse design: the sobol rule with coarse_count points.
    """
    low, high = as_f64(low), as_f64(high)
    check_box(low, high)
    p = low.numel()
    steps = candidate_lattice(lattice_steps, p, settings)
    plan, count = _candidate_plan(p, lattice_steps, low, high, settings)
    if plan in ("enumerate", "grid"):
        points, log_measure = _grid_rule(low, high, steps, int(settings.get("candidate_points_per_axis", 64)))
    else:
        points, log_measure = _sobol_rule(low, high, steps, count, seed)
    return merge_duplicates(points.contiguous(), log_measure)


# ---------------------------------------------------------------------------
# Adaptive candidates: their sizes (adaptive.py refines them)
# ---------------------------------------------------------------------------

PROBE_RADII = 16  # first probe round: evenly spaced radii along each ray
PROBE_REFINE = 16  # second round, per ray: points inside the brackets where the levels' regions end


def adaptive_sizes(p: int, settings: Mapping[str, Any], targets: int = 1) -> dict[str, Any]:
    """Points per case of an adaptive design: coarse, each refined pass, probes and total.

    Every refined pass but the last draws coarse_count points; probes take
    targets · 2p · (PROBE_RADII + PROBE_REFINE); the last pass takes what is left.
    """
    total, coarse = int(settings["candidate_count"]), int(settings["coarse_count"])
    stages = int(settings["refinement_stages"])
    if stages < 1:
        raise ValueError(f"refinement_stages must be at least 1, got {stages}")
    probes = targets * 2 * p * (PROBE_RADII + PROBE_REFINE)
    last = total - coarse * stages - probes
    if coarse < 1 or last < coarse:
        raise ValueError(
            f"candidate_count={total} is too small for an adaptive design with coarse_count={coarse} "
            f"and refinement_stages={stages} in {p} dimensions: it needs at least "
            f"{coarse * (stages + 1) + probes}; raise candidate_count or lower coarse_count"
        )
    return {"coarse": coarse, "passes": [coarse] * (stages - 1) + [last], "probes": probes, "total": total}
