"""Inference analysis: truths, observation ensembles, candidates, ensemble scores,
highest-density (HLD) summaries and the bias/coverage/width/resolution metrics.

Generic on purpose: it works on boxes (low/high tensors), lattice steps and callables,
and knows no study: the study kit (nre_analysis.py) calls it.
"""

import math
from typing import NamedTuple

import numpy as np
import torch

# Network calls always see this many rows (whole candidates, last block padded) when
# chunk_rows allows it, so ensemble scores are bitwise independent of chunk_rows.
EVAL_BLOCK_ROWS = 8192
# Smaller calls are padded to a multiple of this, so every row sits in a full BLAS tile.
ROW_PAD = 64
CANDIDATE_KINDS = ("sobol", "grid", "adaptive")
# Cases summarised at once: bounds the (cases, K) work arrays of hld_summaries.
SUMMARY_CELLS = 1 << 22


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------

def _as_f64(values):
    """Return values as a 1-D CPU float64 tensor."""
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu()


def _check_box(low, high):
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


def lattice_size(low, high, step):
    """Number of lattice points low, low+step, ... that lie in [low, high]."""
    if not step > 0:
        raise ValueError(f"grid_step must be positive, got {step}; fix problem.parameters")
    # Slack of a millionth of a step: 0.2-steps on [0, 10] give 51 points despite rounding.
    return int(math.floor((high - low) / step + 1e-6)) + 1


def lattice_support(low, high, step):
    """The lattice low + k·step inside [low, high] as a float64 tensor."""
    n = lattice_size(float(low), float(high), float(step))
    return float(low) + torch.arange(n, dtype=torch.float64) * float(step)


def snap_to_lattice(theta, low, high, step):
    """Round each column to its lattice low + k·step, clamped into [low, high]."""
    low, high, step = _as_f64(low), _as_f64(high), _as_f64(step)
    top = torch.tensor([lattice_size(a, b, s) - 1 for a, b, s in
                        zip(low.tolist(), high.tolist(), step.tolist())], dtype=torch.float64)
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


def merge_duplicates(points, log_measure):
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


def truth_count(p, settings):
    """Number of truth cases, repeats included."""
    kind = _truth_kind(p, settings)
    if kind == "grid":
        count = int(settings.get("truth_points_per_axis", 7)) ** p
    else:
        count = int(settings.get("sobol_truths", 1024)) * 2 ** (p - 1)
    return count * int(settings.get("repeats", 1))


def make_truths(low, high, grid_step, settings, seed):
    """Truth parameters (T, p) float64 inside the margin-shrunk box."""
    low, high = _as_f64(low), _as_f64(high)
    _check_box(low, high)
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
            axes = [torch.linspace(float(a), float(b), n, dtype=torch.float64)
                    for a, b in zip(inner_low, inner_high)]
        truths = _cartesian(axes)
    else:
        count = int(settings.get("sobol_truths", 1024)) * 2 ** (p - 1)
        if count < 1:
            raise ValueError(f"sobol_truths must be at least 1, got {settings.get('sobol_truths')}")
        truths = inner_low + _sobol(p, count, seed) * (inner_high - inner_low)
    if settings.get("align_truths_to_grid", True):
        if grid_step is None or _as_f64(grid_step).numel() != p:
            raise ValueError("align_truths_to_grid needs one grid_step per parameter; "
                             "set the grid_step of each parameter or align_truths_to_grid: false")
        # Snapped truths may coincide; each stays a case of its own, so the workload is as planned.
        truths = snap_to_lattice(truths, low, high, grid_step)
    return truths.repeat_interleave(repeats, dim=0).contiguous()


def make_observations(simulate, truths, observations, seed):
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

def candidate_lattice(lattice_steps, p, settings):
    """Per-coordinate lattice step of the candidates: the prior's own with native_grid_prior, else None."""
    steps = list(lattice_steps) if lattice_steps is not None else [None] * p
    if len(steps) != p:
        raise ValueError(f"lattice_steps has {len(steps)} entries for {p} parameters")
    if not settings.get("native_grid_prior", True):
        return [None] * p
    return steps


def _candidate_plan(p, lattice_steps, low, high, settings):
    """Decide 'enumerate', 'grid', 'sobol' or 'adaptive' and the shared design's size before merging.

    An adaptive design shares a coarse Sobol design of coarse_count points; each case
    then refines it on its own (see refine_case).
    """
    kind = settings.get("kind", "sobol")
    if kind not in CANDIDATE_KINDS:
        raise ValueError(f"candidates kind must be one of {', '.join(CANDIDATE_KINDS)}, got {kind!r}")
    steps = candidate_lattice(lattice_steps, p, settings)
    low, high = _as_f64(low), _as_f64(high)
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


def candidate_design(p, lattice_steps, low, high, settings):
    """The design each case is scored on: 'enumerate', 'grid', 'sobol' or 'adaptive'."""
    return _candidate_plan(p, lattice_steps, low, high, settings)[0]


def candidate_count_for(p, lattice_steps, low, high, settings):
    """Size of the shared design (before duplicate merging) without building it."""
    return _candidate_plan(p, lattice_steps, low, high, settings)[1]


def points_per_case(p, lattice_steps, low, high, settings, targets=1):
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


def make_candidates(low, high, lattice_steps, settings, seed):
    """Candidate points (K, p) and their log quadrature weights (K,), duplicates merged.

    Lattice coordinates (with native_grid_prior) carry counting measure. An all-lattice
    box with at most max_enumerated points is enumerated exactly (weight 1 each). The
    grid kind always uses the full lattice support on lattice axes. The sobol kind with
    lattice axes is a Monte Carlo rule over lattice × continuous: lattice indices are
    drawn uniformly (floor of the Sobol coordinate times the lattice size) and every
    point weighs continuous_volume · Π lattice_sizes / K. The adaptive kind returns its
    coarse design: the sobol rule with coarse_count points.
    """
    low, high = _as_f64(low), _as_f64(high)
    _check_box(low, high)
    p = low.numel()
    steps = candidate_lattice(lattice_steps, p, settings)
    plan, count = _candidate_plan(p, lattice_steps, low, high, settings)
    if plan in ("enumerate", "grid"):
        axes, weights = [], []
        n = int(settings.get("candidate_points_per_axis", 64))
        for j, step in enumerate(steps):
            if step is None:
                a, w = _trapezoid(float(low[j]), float(high[j]), n)
            else:
                a = lattice_support(low[j], high[j], step)
                w = torch.ones_like(a)
            axes.append(a)
            weights.append(w.log())
        points = _cartesian(axes)
        log_measure = _cartesian(weights).sum(dim=1)
    else:
        unit = _sobol(p, count, seed)
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
        points = torch.stack(columns, dim=1)
        log_measure = torch.full((count,), log_total - math.log(count), dtype=torch.float64)
    return merge_duplicates(points.contiguous(), log_measure)


# ---------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------

def _block_candidates(m, count, chunk_rows):
    """Candidates per network call: fixed by EVAL_BLOCK_ROWS unless chunk_rows is smaller.

    The candidates are spread evenly over the fewest blocks that fit, so the last block
    is not mostly padding; every block still has the same shape.
    """
    rows = min(EVAL_BLOCK_ROWS, int(chunk_rows))
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    largest = max(1, min(rows // m, count))
    blocks = -(-count // largest)
    return -(-count // blocks)


def _sum_over_observations(values):
    """Sum a (c, m) block over m in float64; each row's order depends on m alone, not on c."""
    return values.to(torch.float64).sum(dim=1)


def ensemble_scores(logit_fn, observations, points, chunk_rows):
    """S(θ) = Σ_k logit(x_k, θ) for every candidate, shape (K,) float64.

    Rows [x_k, θ] are built for whole candidates (all m observations) in blocks; the
    network always sees the same fixed-size, zero-padded blocks while chunk_rows >=
    EVAL_BLOCK_ROWS, so the scores are bitwise independent of chunk_rows there. Smaller
    chunk_rows shrink the blocks (at least one candidate, padded to a multiple of ROW_PAD).
    """
    x = observations.to(torch.float32)
    (m, d), (count, p) = x.shape, points.shape
    theta = points.to(device=x.device, dtype=torch.float32)
    block = _block_candidates(m, count, chunk_rows)
    # One input buffer for every block: the observations never change, only θ does.
    rows = torch.zeros(-(-block * m // ROW_PAD) * ROW_PAD, d + p, dtype=torch.float32, device=x.device)
    rows[:block * m, :d] = x.repeat(block, 1)
    thetas = rows[:block * m, d:].view(block, m, p)
    scores = torch.empty(count, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        for start in range(0, count, block):
            chunk = theta[start:start + block]
            c = chunk.shape[0]
            thetas[:c] = chunk[:, None, :]
            logits = logit_fn(rows).reshape(-1)[:c * m].reshape(c, m)
            torch.sum(logits, dim=1, dtype=torch.float64, out=scores[start:start + c])
    return scores.cpu()


def exact_scores(log_likelihood, observations, points, chunk_rows=EVAL_BLOCK_ROWS):
    """Σ_k log p(x_k | θ) per candidate with `log_likelihood(x (1,m,d), θ (c,1,p)) -> (c,m)`."""
    x = observations.unsqueeze(0)
    m, count = observations.shape[0], points.shape[0]
    block = max(1, int(chunk_rows) // m)
    scores = torch.empty(count, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, count, block):
            theta = points[start:start + block].to(observations.device).unsqueeze(1)
            values = log_likelihood(x, theta).reshape(theta.shape[0], m)
            scores[start:start + theta.shape[0]] = _sum_over_observations(values).cpu()
    return scores


# ---------------------------------------------------------------------------
# Highest-density summaries
# ---------------------------------------------------------------------------

def _check_levels(levels):
    """Levels as a float64 array, each in (0, 1]."""
    levels = np.asarray(list(levels), dtype=np.float64)
    if levels.size == 0 or not ((levels > 0) & (levels <= 1)).all():
        raise ValueError(f"levels must be enclosed masses in (0, 1], got {levels.tolist()}")
    return levels


def _check_scores(scores, truth_scores):
    """Raise naming the first case whose scores are NaN, +inf or all -inf."""
    bad = torch.isnan(scores).any(dim=1) | torch.isposinf(scores).any(dim=1)
    bad |= torch.isneginf(scores).all(dim=1) | torch.isnan(truth_scores) | torch.isposinf(truth_scores)
    if bad.any():
        case = int(torch.nonzero(bad)[0])
        raise ValueError(f"case {case}: scores must be finite or -inf, not NaN/+inf, and not all -inf; "
                         "check the network output or the likelihood for that case")


def _mass_above(sorted_scores, cumulative, values, side):
    """Per case, the normalised mass of the candidates denser than its value ("left") or as dense ("right")."""
    count = torch.searchsorted(-sorted_scores, -values[:, None], side=side)
    mass = torch.gather(cumulative, 1, (count - 1).clamp(min=0))[:, 0]
    return torch.where(count[:, 0] > 0, mass, torch.zeros_like(mass))


def _summarise_block(scores, log_measure, points, truth_scores, levels):
    """HLD summary of a block of cases (see hld_summaries)."""
    n, count = scores.shape
    log_mass = scores + log_measure
    log_normalizer = torch.logsumexp(log_mass, dim=1)
    q = torch.exp(log_mass - log_normalizer[:, None])
    ess = 1.0 / (q * q).sum(dim=1)
    # Rank by density; the stable sort keeps the first candidate first among ties.
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    sorted_scores = torch.gather(scores, 1, order)
    sorted_q = torch.gather(q, 1, order)
    running = torch.cumsum(sorted_q, dim=1)
    cumulative = running / running[:, -1:]  # exact 1 at the end, so level 1 is reachable
    level_t = torch.as_tensor(levels, dtype=torch.float64)
    reach = torch.searchsorted(cumulative, level_t.expand(n, -1).contiguous(), side="left")
    threshold = torch.gather(sorted_scores, 1, reach.clamp(max=count - 1))
    # Every tie at the cutoff joins: the region is the prefix of scores >= threshold.
    size = torch.searchsorted(-sorted_scores, -threshold, side="right")
    last = size - 1
    mass = torch.gather(cumulative, 1, last)
    # Kish ESS of the points inside the widest region: how well that region is resolved.
    widest = last[:, int(np.argmax(levels))][:, None]
    region_ess = (torch.gather(running, 1, widest) ** 2
                  / torch.gather(torch.cumsum(sorted_q * sorted_q, dim=1), 1, widest))[:, 0]
    # The truth's credibility: the mass of the candidates denser than the truth. The truth is
    # in the region of level α exactly when its credibility is below α (as `covered` says).
    # With its ties (such as its own lattice point) the mass reaches credibility_upper.
    credibility = _mass_above(sorted_scores, cumulative, truth_scores, "left")
    credibility_upper = _mass_above(sorted_scores, cumulative, truth_scores, "right")
    lower = torch.empty(n, len(levels), points.shape[1], dtype=torch.float64)
    upper = torch.empty_like(lower)
    for j in range(points.shape[1]):
        column = points[:, j][order]
        lower[:, :, j] = torch.gather(torch.cummin(column, dim=1).values, 1, last)
        upper[:, :, j] = torch.gather(torch.cummax(column, dim=1).values, 1, last)
    return {
        "lower": lower, "upper": upper, "mass": mass, "threshold": threshold,
        "covered": truth_scores[:, None] >= threshold,
        "mode": points[order[:, 0]], "ess": ess, "log_normalizer": log_normalizer, "region_ess": region_ess,
        "credibility": credibility, "credibility_upper": credibility_upper,
    }


def hld_summaries(scores, log_measure, points, truth_scores, levels):
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
    log_measure = _as_f64(log_measure)
    points = torch.as_tensor(points, dtype=torch.float64).cpu()
    truth_scores = _as_f64(truth_scores)
    if log_measure.numel() != scores.shape[1] or points.shape[0] != scores.shape[1]:
        raise ValueError("scores, log_measure and points disagree on the candidate count")
    if truth_scores.numel() != scores.shape[0]:
        raise ValueError("truth_scores needs one value per case")
    levels = _check_levels(levels)
    _check_scores(scores, truth_scores)
    step = max(1, SUMMARY_CELLS // max(1, scores.shape[1]))
    parts = [_summarise_block(scores[i:i + step], log_measure, points, truth_scores[i:i + step], levels)
             for i in range(0, scores.shape[0], step)]
    return {key: torch.cat([part[key] for part in parts]).numpy() for key in parts[0]}


# ---------------------------------------------------------------------------
# Adaptive candidates: a coarse global pass, then refined passes per case and target
# ---------------------------------------------------------------------------

INFLATION = 1.5      # a refined proposal's sd over the density's estimated sd: wide enough not to clip it
REACH = 4.0          # a refined box spans the proposal mean ± REACH proposal sds (and the modes found)
MAX_SHRINK = 4.0     # a pass narrows the previous spread at most this much: few effective points mislead
PROBE_RADII = 16     # first probe round: evenly spaced radii along each ray
PROBE_REFINE = 16    # second round, per ray: points inside the brackets where the levels' regions end
PROBE_REACH = 1.5    # rays reach this multiple of the farthest region point's Mahalanobis radius


class Box(NamedTuple):
    """The prior's support: bounds (p,) (lattice axes: first and last lattice point) and steps."""
    low: torch.Tensor
    high: torch.Tensor
    lattice: torch.Tensor   # bool (p,)
    step: torch.Tensor      # the lattice step, 1 on continuous axes

    def half_cell(self):
        """Half a lattice step on lattice axes, 0 elsewhere: a lattice point's cell reaches this far."""
        return torch.where(self.lattice, self.step / 2, torch.zeros_like(self.step))

    def log_measure(self):
        """Log of the box's measure: Lebesgue on continuous axes, counting on lattice axes."""
        counts = torch.round((self.high - self.low) / self.step) + 1
        return float(torch.where(self.lattice, counts, self.high - self.low).log().sum())

    def snap(self, values, low=None, high=None):
        """Values clamped into [low, high] (the box by default), lattice axes rounded onto the lattice."""
        low = self.low if low is None else low
        high = self.high if high is None else high
        k = torch.round((values - self.low) / self.step)
        on_lattice = self.low + k * self.step
        return torch.maximum(torch.minimum(torch.where(self.lattice, on_lattice, values), high), low)


def support_box(low, high, lattice_steps):
    """The Box of a prior's support; lattice axes end on their last lattice point."""
    low, high = _as_f64(low), _as_f64(high)
    _check_box(low, high)
    lattice = torch.tensor([s is not None for s in lattice_steps])
    step = torch.tensor([1.0 if s is None else float(s) for s in lattice_steps], dtype=torch.float64)
    last = torch.tensor([float(lattice_support(a, b, s)[-1]) if s is not None else b
                         for a, b, s in zip(low.tolist(), high.tolist(), lattice_steps)], dtype=torch.float64)
    return Box(low, last, lattice, step)


class Proposal(NamedTuple):
    """A product of normals truncated to a box [low, high]; a lattice point takes its cell's mass."""
    mean: torch.Tensor
    sd: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    count: int              # points drawn from it


def adaptive_sizes(p, settings, targets=1):
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
        raise ValueError(f"candidate_count={total} is too small for an adaptive design with coarse_count={coarse} "
                         f"and refinement_stages={stages} in {p} dimensions: it needs at least "
                         f"{coarse * (stages + 1) + probes}; raise candidate_count or lower coarse_count")
    return {"coarse": coarse, "passes": [coarse] * (stages - 1) + [last], "probes": probes, "total": total}


def _log1mexp(x):
    """log(1 − exp(x)) for x <= 0, accurate on both sides of −log 2."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _log_normal_interval(a, b):
    """log(Φ(b) − Φ(a)) for a <= b, accurate in both tails."""
    upper = a > 0   # both in the upper tail: mirror into the lower one, where Φ keeps its digits
    a, b = torch.where(upper, -b, a), torch.where(upper, -a, b)
    log_b = torch.special.log_ndtr(b)
    return log_b + _log1mexp(torch.special.log_ndtr(a) - log_b)


def _standard_z(proposal, box):
    """The proposal's support [low, high] (lattice cells included) in standard units."""
    half = box.half_cell()
    return (proposal.low - half - proposal.mean) / proposal.sd, (proposal.high + half - proposal.mean) / proposal.sd


def draw_proposal(proposal, unit, box):
    """Map unit-cube points (n, p) through the truncated normals' inverse CDF; lattice axes snap."""
    za, zb = _standard_z(proposal, box)
    pa, pb = torch.special.ndtr(za), torch.special.ndtr(zb)
    z = torch.special.ndtri(pa + unit * (pb - pa))
    values = proposal.mean + proposal.sd * torch.maximum(torch.minimum(z, zb), za)
    return box.snap(values, proposal.low, proposal.high)


def proposal_log_density(proposals, points, box):
    """Log density (C, n) of stacked proposals (fields (C, p)) at points (n, p): Lebesgue ×
    counting measure, −inf outside each proposal's box."""
    inside = torch.ones(points.shape[0], proposals.mean.shape[0], dtype=torch.bool)
    for j in range(points.shape[1]):
        column = points[:, j:j + 1]
        inside &= (column >= proposals.low[:, j]) & (column <= proposals.high[:, j])
    continuous = ~box.lattice
    x, mean, inverse = points[:, continuous], proposals.mean[:, continuous], proposals.sd[:, continuous] ** -2
    # Σ_j (x_j − μ_j)²/σ_j² of every point under every proposal at once, as matrix products.
    quadratic = torch.addmm((mean * mean * inverse).sum(dim=1), x * x, inverse.T)
    quadratic.addmm_(x, (mean * inverse).T, alpha=-2)
    total = -0.5 * quadratic - (torch.log(proposals.sd[:, continuous]).sum(dim=1)
                                + 0.5 * int(continuous.sum()) * math.log(2 * math.pi))
    if bool(box.lattice.any()):
        sd = proposals.sd[:, None, box.lattice]
        z = (points[None, :, box.lattice] - proposals.mean[:, None, box.lattice]) / sd
        cell = box.half_cell()[box.lattice] / sd
        total = total + _log_normal_interval(z - cell, z + cell).sum(dim=-1).T
    za, zb = _standard_z(proposals, box)
    total = total - _log_normal_interval(za, zb).sum(dim=-1)
    return torch.where(inside, total, torch.full_like(total, -math.inf)).T


def stack_proposals(proposals):
    """Proposals stacked along a first axis, for proposal_log_density."""
    return Proposal(*(torch.stack([getattr(c, name) for c in proposals]) for name in ("mean", "sd", "low", "high")),
                    [c.count for c in proposals])


def mixture_log_weights(log_densities, counts, multiplicity, coarse_count, log_box):
    """Deterministic-mixture importance weights of every point drawn so far, as logs.

    All points together are a sample of the mixture of the uniform coarse design and
    the refined proposals (log_densities (C, n) at every point, `counts` points each),
    so a point weighs 1/Σ_c n_c g_c(θ): an unbiased rule for the box's measure. Coarse
    points merged on a lattice weigh their multiplicity (log given, first) times that.
    """
    uniform = torch.full((1, log_densities.shape[1]), math.log(coarse_count) - log_box, dtype=torch.float64)
    log_counts = torch.tensor(counts, dtype=torch.float64).reshape(-1, 1).log()
    log_weights = -torch.logsumexp(torch.cat([uniform, log_counts + log_densities]), dim=0)
    log_weights[:multiplicity.numel()] += multiplicity
    return log_weights


def weighted_moments(points, log_q):
    """Mean (p,) and covariance (p, p) of the points under normalised weights exp(log_q)."""
    q = torch.softmax(log_q, dim=0)
    mean = q @ points
    centred = points - mean
    return mean, (q[:, None] * centred).T @ centred


def fit_proposal(points, log_q, spread, box, anchors, count):
    """The next proposal for a density given by weights exp(log_q) on points.

    Its sd is the density's, inflated, but at least spread / MAX_SHRINK (the previous
    spread: estimates from few effective points are too narrow). Its box reaches REACH
    sds either side of the mean and always holds the anchors (the modes found so far).
    """
    mean, covariance = weighted_moments(points, log_q)
    floor = torch.where(box.lattice, box.step / 2, (box.high - box.low) * 1e-9)
    # Few effective points place the mean roughly and see too little of the tails: widen more.
    inflation = INFLATION * (1 + 1 / math.sqrt(effective_sample_size(log_q)))
    sd = torch.maximum(torch.maximum(inflation * covariance.diagonal().sqrt(), spread / MAX_SHRINK), floor)
    low = torch.maximum(torch.minimum(mean - REACH * sd, anchors.min(dim=0).values), box.low)
    high = torch.minimum(torch.maximum(mean + REACH * sd, anchors.max(dim=0).values), box.high)
    # Lattice axes: widen outwards onto the lattice.
    low = torch.where(box.lattice, box.low + torch.floor((low - box.low) / box.step + 1e-9) * box.step, low)
    high = torch.where(box.lattice, box.low + torch.ceil((high - box.low) / box.step - 1e-9) * box.step, high)
    return Proposal(mean, sd, torch.maximum(low, box.low), torch.minimum(high, box.high), int(count))


def case_seed(seed, case):
    """A 63-bit seed of one case's refined passes, from the design's seed and the case index."""
    return int(np.random.SeedSequence([int(seed), int(case)]).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def _shares(count, parts):
    """Split count into `parts` near-equal shares, the larger first."""
    return [count // parts + (i < count % parts) for i in range(parts)]


def _refined_passes(score_fn, coarse_points, multiplicity, scores, box, sizes, seed):
    """Run the refined passes: each target fits its next proposal on its own weighted scores.

    Returns every point drawn (coarse first), their mixture weights, each target's
    scores on them and each target's last proposal.
    """
    targets, points = list(scores), coarse_points
    anchors = {t: coarse_points[int(torch.argmax(scores[t]))] for t in targets}   # the coarse modes
    spread = {t: (box.high - box.low + 2 * box.half_cell()) / math.sqrt(12) for t in targets}  # uniform's sd
    components, last, log_box = [], {}, box.log_measure()
    densities = torch.empty(0, points.shape[0], dtype=torch.float64)   # every proposal at every point
    engine = torch.quasirandom.SobolEngine(points.shape[1], scramble=True, seed=seed)
    for size in sizes["passes"]:
        log_weights = mixture_log_weights(densities, [c.count for c in components], multiplicity,
                                          sizes["coarse"], log_box)
        fitted = []
        for target, share in zip(targets, _shares(size, len(targets))):
            best = points[int(torch.argmax(scores[target]))]
            fitted.append(fit_proposal(points, scores[target] + log_weights, spread[target], box,
                                       torch.stack([anchors[target], best]), share))
            last[target], spread[target] = fitted[-1], fitted[-1].sd
        fresh = torch.cat([draw_proposal(proposal, engine.draw(proposal.count, dtype=torch.float64), box)
                           for proposal in fitted])
        fresh_scores = score_fn(fresh)
        densities = torch.cat([densities, proposal_log_density(stack_proposals(fitted), points, box)])
        components += fitted
        densities = torch.cat([densities, proposal_log_density(stack_proposals(components), fresh, box)], dim=1)
        points = torch.cat([points, fresh])
        scores = {t: torch.cat([scores[t], fresh_scores[t]]) for t in targets}
    log_weights = mixture_log_weights(densities, [c.count for c in components], multiplicity, sizes["coarse"], log_box)
    return points, log_weights, scores, last


def _merged(points, log_weights, scores, box):
    """Merge repeated lattice points (weights summed), then scale the weights to the box's measure."""
    if bool(box.lattice.any()):
        keep, group = _first_occurrences(points)
        merged = np.full(keep.size, -np.inf)
        np.logaddexp.at(merged, group, log_weights.numpy())
        keep = torch.as_tensor(keep)
        points, log_weights = points[keep], torch.from_numpy(merged)
        scores = {t: s[keep] for t, s in scores.items()}
    # The mixture rule integrates the box's measure without bias; rescaling makes it exact and
    # leaves every normalised density unchanged.
    return points, log_weights + (box.log_measure() - torch.logsumexp(log_weights, dim=0)), scores


def _ray_frame(points, scores, covariance, origin, threshold, box):
    """Rays from the origin along ±Σe_j/√Σ_jj, where an ellipsoid's extent along axis j lies, and their ends.

    Σ is the density's covariance. A ray ends at PROBE_REACH times the farthest
    Mahalanobis radius of the widest region's points, or where it leaves the box.
    """
    floor = torch.where(box.lattice, box.step / 2, (box.high - box.low) * 1e-6)
    covariance = covariance + torch.diag(floor * floor)
    directions = covariance / covariance.diagonal().sqrt()[:, None]
    rays = torch.cat([directions, -directions])
    offsets = points[scores >= threshold] - origin
    radius = torch.linalg.solve_triangular(torch.linalg.cholesky(covariance), offsets.T, upper=False).norm(dim=0)
    reach = PROBE_REACH * max(float(radius.max()) if radius.numel() else 0.0, 1.0)
    safe = torch.where(rays == 0, torch.ones_like(rays), rays)
    exits = torch.where(rays > 0, (box.high - origin) / safe,
                        torch.where(rays < 0, (box.low - origin) / safe, torch.full_like(rays, math.inf)))
    return rays, exits.min(dim=1).values.clamp(min=0.0, max=reach)


def _ray_points(origin, rays, radii, box):
    """Points origin + t·ray for radii (rays, n), snapped into the box, shape (rays · n, p)."""
    return box.snap((origin + radii[:, :, None] * rays[:, None, :]).reshape(-1, origin.numel()))


def _bracket_radii(scores, radii, thresholds):
    """Second-round radii per ray: PROBE_REFINE points shared among the levels' brackets.

    A level's bracket lies between the farthest first-round radius inside its region
    (0: the origin) and the next one; a ray inside throughout repeats its end.
    """
    rays, count = radii.shape
    padded = torch.cat([torch.zeros(rays, 1, dtype=radii.dtype), radii], dim=1)
    position = torch.arange(1, count + 1)
    parts = []
    for threshold, share in zip(thresholds, _shares(PROBE_REFINE, len(thresholds))):
        last = ((scores >= threshold) * position).max(dim=1).values[:, None]   # 0 when no radius is inside
        inner, outer = padded.gather(1, last), padded.gather(1, (last + 1).clamp(max=count))
        fraction = torch.arange(1, share + 1, dtype=radii.dtype) / (share + 1)
        parts.append(inner + (outer - inner) * fraction)
    return torch.cat(parts, dim=1)


def _probe(score_fn, frames, box):
    """Two rounds of probes along every target's rays; returns the points and every target's scores.

    frames: {target: (origin, rays, ends, thresholds)}. One call per round scores all
    targets' probes together.
    """
    first = {t: ends[:, None] * torch.arange(1, PROBE_RADII + 1, dtype=torch.float64) / PROBE_RADII
             for t, (_, _, ends, _) in frames.items()}
    points = torch.cat([_ray_points(origin, rays, first[t], box) for t, (origin, rays, _, _) in frames.items()])
    scores = score_fn(points)
    second, offset = {}, 0
    for target, (_, rays, _, thresholds) in frames.items():
        size = rays.shape[0] * PROBE_RADII
        own = scores[target][offset:offset + size].reshape(rays.shape[0], PROBE_RADII)
        second[target] = _bracket_radii(own, first[target], thresholds)
        offset += size
    more = torch.cat([_ray_points(origin, rays, second[t], box) for t, (origin, rays, _, _) in frames.items()])
    more_scores = score_fn(more)
    return torch.cat([points, more]), {t: torch.cat([scores[t], more_scores[t]]) for t in scores}


def _widen(summary, probes, probe_scores, best):
    """Extend a one-case summary's bounds by the probes inside each region, and its mode by a higher probe.

    Probes carry no measure: they sharpen where a region ends without changing its mass.
    """
    probes, probe_scores = probes.numpy(), probe_scores.numpy()
    for level, threshold in enumerate(summary["threshold"][0]):
        inside = probe_scores >= threshold
        if inside.any():
            summary["lower"][0, level] = np.minimum(summary["lower"][0, level], probes[inside].min(axis=0))
            summary["upper"][0, level] = np.maximum(summary["upper"][0, level], probes[inside].max(axis=0))
    if probe_scores.size and probe_scores.max() > best:
        summary["mode"][0] = probes[int(np.argmax(probe_scores))]


def refinement_checks(points, log_q, moments, proposal, box):
    """Edge mass and disagreement of a target's refined density (moments: its mean and covariance)
    with the last proposal that placed it.

    Edge mass: the density's mass outside the last box shrunk by one proposal sd (not on
    sides where the box is the prior's). Disagreement: the larger of the largest mean
    shift over 2 proposal sds and the largest density sd over √2 proposal sds; above 1
    the earlier passes misjudged where the mass is, or importance weights may have
    infinite variance.
    """
    q = torch.softmax(log_q, dim=0)
    mean, covariance = moments
    inner_low = torch.where(proposal.low > box.low, proposal.low + proposal.sd, box.low)
    inner_high = torch.where(proposal.high < box.high, proposal.high - proposal.sd, box.high)
    edge = ((points < inner_low) | (points > inner_high)).any(dim=1)
    shift = ((mean - proposal.mean).abs() / proposal.sd).max()
    spread = (covariance.diagonal().sqrt() / proposal.sd).max()
    return float(q[edge].sum()), float(torch.maximum(shift / 2, spread / math.sqrt(2)))


def _coarse_scores(score_fn, coarse_points, truth, case):
    """Every target's scores on the coarse design and at the truth, in one call; unusable scores raise."""
    first = score_fn(torch.cat([coarse_points, truth[None]]))
    for target, values in first.items():
        values = values[:-1]
        if not torch.isfinite(values).any() or torch.isnan(values).any() or torch.isposinf(values).any():
            raise ValueError(f"case {case}: {target} scores on the coarse candidates are NaN, +inf or all -inf; "
                             "check the network output or the likelihood for that case")
    return {t: s[:-1] for t, s in first.items()}, {t: s[-1:] for t, s in first.items()}


def _measured_summaries(points, log_weights, scores, truth_scores, levels, box):
    """Per target: the summary on the measured points, the probe frame and the density's moments."""
    summaries, frames, moments = {}, {}, {}
    for target, values in scores.items():
        summary = hld_summaries(values[None], log_weights, points, truth_scores[target], levels)
        moments[target] = weighted_moments(points, values + log_weights)
        origin = moments[target][0]   # the mean: far closer to a region's centre than the best point found
        rays, ends = _ray_frame(points, values, moments[target][1], origin, summary["threshold"][0].min(), box)
        frames[target] = (origin, rays, ends, summary["threshold"][0].tolist())
        summaries[target] = summary
    return summaries, frames, moments


def refine_case(score_fn, coarse_points, coarse_log_measure, truth, box, levels, sizes, seed, case=0):
    """Adaptive candidates and highest-density summaries of one case, for every target score_fn returns.

    `score_fn(points (n, p)) -> {target: scores (n,)}` is called on the coarse design and
    the truth, once per refined pass and twice for probes, so every case evaluates
    exactly sizes["total"] points besides its truth. Each pass fits, per target and on
    that target's own scores (never the truth), a product of truncated normals with
    the density's mean and inflated sd (see fit_proposal); lattice axes take the mass
    of each lattice point's cell, so they keep counting measure. The points of all
    passes, coarse included, carry deterministic-mixture importance weights, summed
    over repeated lattice points and scaled to the box's measure exactly. Then
    zero-measure probes along rays from each density's mean (see _ray_frame) sharpen projected
    bounds: they change no mass, threshold or coverage, only where a region is seen to
    end. Returns points and log_measure (probes last, at −inf), scores (the truth's
    last), one-case summaries (with edge_mass and disagreement) and the last proposal
    per target, and the count of points evaluated.
    """
    levels = _check_levels(levels)
    scores, truth_scores = _coarse_scores(score_fn, coarse_points, truth, case)
    multiplicity = coarse_log_measure + math.log(sizes["coarse"]) - box.log_measure()
    # Coarse points merged on a lattice leave their places to the last pass: every case evaluates the same count.
    passes = sizes["passes"][:-1] + [sizes["passes"][-1] + sizes["coarse"] - coarse_points.shape[0]]
    points, log_weights, scores, last = _refined_passes(
        score_fn, coarse_points, multiplicity, scores, box, dict(sizes, passes=passes), case_seed(seed, case))
    points, log_weights, scores = _merged(points, log_weights, scores, box)
    summaries, frames, moments = _measured_summaries(points, log_weights, scores, truth_scores, levels, box)
    probes, probe_scores = _probe(score_fn, frames, box)
    for target, summary in summaries.items():
        _widen(summary, probes, probe_scores[target], float(scores[target].max()))
        edge, disagreement = refinement_checks(points, scores[target] + log_weights, moments[target], last[target],
                                               box)
        summary["edge_mass"], summary["disagreement"] = np.array([edge]), np.array([disagreement])
    return {"points": torch.cat([points, probes]),
            "log_measure": torch.cat([log_weights, torch.full((probes.shape[0],), -math.inf, dtype=torch.float64)]),
            "scores": {t: torch.cat([scores[t], probe_scores[t], truth_scores[t]]) for t in scores},
            "summaries": summaries, "proposals": last,
            "evaluated": coarse_points.shape[0] + sum(passes) + probes.shape[0]}


# ---------------------------------------------------------------------------
# Metrics (JSON-able: python floats/lists, None where undefined)
# ---------------------------------------------------------------------------

def finite_or_none(value):
    """A python float, or None when undefined (NaN/inf or no data)."""
    value = float(value)
    return value if math.isfinite(value) else None


def _mean(values):
    """Mean as a JSON number, None for an empty array."""
    values = np.asarray(values, dtype=np.float64)
    return finite_or_none(values.mean()) if values.size else None


def level_key(level):
    """The JSON key of a level, e.g. '0.68'."""
    return f"{float(level):g}"


def bias_metrics(modes, truths, names):
    """Per-axis signed/absolute mean error and RMSE of the modes, and overall RMSE."""
    error = np.asarray(modes, dtype=np.float64) - np.asarray(truths, dtype=np.float64)
    per_axis = {}
    for j, name in enumerate(names):
        e = error[:, j]
        per_axis[name] = {"signed": _mean(e), "absolute": _mean(np.abs(e)),
                          "rmse": finite_or_none(math.sqrt(e.dot(e) / e.size)) if e.size else None}
    rmse = finite_or_none(math.sqrt((error ** 2).mean())) if error.size else None
    return {"cases": int(error.shape[0]), "per_axis": per_axis, "rmse": rmse}


def wilson_interval(successes, trials, z=1.959963984540054):
    """The 95% Wilson score interval [lo, hi] of a binomial proportion, None without trials."""
    if trials == 0:
        return None
    share, spread = successes / trials, z * z / trials
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def randomised_inside(credibility, credibility_upper, level):
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


def coverage_metrics(summaries, truths, levels, names):
    """Per level: the fraction of truths inside the projected bounds per axis (and their mean) and
    inside the joint region, with the case count and 95% Wilson intervals of each fraction; and
    `lattice`, the randomised joint coverage (see randomised_inside), nominal for an exact
    likelihood on lattice priors too, with `lattice_interval` (Wilson, as if of `cases` draws).
    Without the credibility fields `lattice` is `joint`."""
    truths = np.asarray(truths, dtype=np.float64)
    cases = int(truths.shape[0])
    randomised = "credibility" in summaries and "credibility_upper" in summaries
    result = {}
    for i, level in enumerate(_check_levels(levels)):
        inside = (summaries["lower"][:, i] <= truths) & (truths <= summaries["upper"][:, i])
        covered = np.asarray(summaries["covered"][:, i])
        lattice = (randomised_inside(summaries["credibility"], summaries["credibility_upper"], level)
                   if randomised else covered.astype(np.float64))
        result[level_key(level)] = {
            "nominal": float(level), "cases": cases,
            "per_axis": {name: _mean(inside[:, j]) for j, name in enumerate(names)},
            "per_axis_interval": {name: wilson_interval(int(inside[:, j].sum()), cases)
                                  for j, name in enumerate(names)},
            "mean": _mean(inside.mean(axis=1)) if inside.size else None,
            "joint": _mean(covered), "interval": wilson_interval(int(covered.sum()), cases),
            "lattice": _mean(lattice), "lattice_interval": wilson_interval(float(lattice.sum()), cases),
        }
    return result


def width_metrics(summaries, levels, names):
    """Mean projected width (upper − lower) per level, per axis and averaged over axes."""
    result = {}
    for i, level in enumerate(_check_levels(levels)):
        width = summaries["upper"][:, i] - summaries["lower"][:, i]
        result[level_key(level)] = {
            "per_axis": {name: _mean(width[:, j]) for j, name in enumerate(names)},
            "mean": _mean(width.mean(axis=1)) if width.size else None,
        }
    return result


MIN_REGION_ESS = 100       # effective points a widest region needs before its mass and bounds are trusted
MAX_EDGE_MASS = 0.01       # mass allowed near the edge of a refined box
MAX_FLAGGED_SHARE = 0.01   # a larger share of flagged cases raises the warning


def resolution_flags(summaries, design):
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
    return (f"{flagged['any']} of {cases} cases are under-resolved ({flagged['few_effective_points']} with fewer "
            f"than {MIN_REGION_ESS} effective points in the {max(levels):g} region, {flagged['edge_mass']} with "
            f"mass at the edge of the refined box, {flagged['disagreement']} where the refined density "
            "disagrees with the passes that placed it)")


def resolution_metrics(summaries, candidate_count, levels, design="sobol"):
    """Candidate count, ESS spread, attained mass per level, counts of under-resolved cases, a warning."""
    levels = _check_levels(levels)
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
    if problems and design != "enumerate":   # an enumerated lattice is exact, however few points carry the mass
        fix = ("raise inference.candidates.candidate_count or refinement_stages" if design == "adaptive" else
               "set inference.candidates.kind to 'adaptive' or raise candidate_count or candidate_points_per_axis")
        warning = "low candidate resolution: " + "; ".join(problems) + "; " + fix
    return {
        "design": design, "candidate_count": int(candidate_count), "cases": int(ess.size),
        "ess_min": finite_or_none(ess.min()) if ess.size else None,
        "ess_median": median,
        "ess_median_fraction": finite_or_none(median / candidate_count) if median is not None and candidate_count else None,
        "region_ess_min": finite_or_none(region_ess.min()) if region_ess.size else None,
        "region_ess_median": finite_or_none(np.median(region_ess)) if region_ess.size else None,
        "attained_mass": attained, "flagged": flagged, "warning": warning,
    }


# ---------------------------------------------------------------- classification

def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of `values`, ties sharing their average rank."""
    _, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    return (ends - (counts.to(torch.float64) - 1) / 2)[inverse]


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
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

def effective_sample_size(log_weights):
    """Kish's effective sample size (Σw)²/Σw² of weights given as logs."""
    log_weights = torch.as_tensor(log_weights, dtype=torch.float64)
    return finite_or_none(torch.exp(2 * torch.logsumexp(log_weights, 0) - torch.logsumexp(2 * log_weights, 0)))


def wasserstein_1d(a, a_weights, b, b_weights):
    """W1 between two weighted empirical distributions on the line: ∫|F_a − F_b| dx."""
    values = torch.cat([a, b])
    order = torch.argsort(values)
    masses = torch.cat([a_weights / a_weights.sum(), -b_weights / b_weights.sum()])[order]
    gaps = torch.diff(values[order])
    return float((torch.cumsum(masses, 0)[:-1].abs() * gaps).sum())


def sliced_wasserstein(a, b, b_log_weights=None, projections=64, seed=0):
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
    directions = torch.randn(projections, a.shape[1], generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)
    directions /= directions.norm(dim=1, keepdim=True)
    return sum(wasserstein_1d(a @ d, a_weights, b @ d, b_weights) for d in directions) / projections
