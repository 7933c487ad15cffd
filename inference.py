"""Inference analysis: truths, observation ensembles, candidates, ensemble scores,
highest-density (HLD) summaries and the bias/coverage/width/resolution metrics.

Generic on purpose: it works on boxes (low/high tensors), lattice steps and callables,
and knows nothing about the Gaussian study (the README's study section describes it).
"""

import math

import numpy as np
import torch

# Network calls always see this many rows (whole candidates, last block padded) when
# chunk_rows allows it, so ensemble scores are bitwise independent of chunk_rows.
EVAL_BLOCK_ROWS = 8192
# Smaller calls are padded to a multiple of this, so every row sits in a full BLAS tile.
ROW_PAD = 64
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
    """Decide 'enumerate', 'grid' or 'sobol' and the candidate count before merging."""
    kind = settings.get("kind", "sobol")
    if kind not in ("sobol", "grid"):
        raise ValueError(f"candidates kind must be sobol or grid, got {kind!r}")
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
    count = int(settings.get("candidate_count", 256))
    if count < 1:
        raise ValueError(f"candidate_count must be at least 1, got {count}")
    return "sobol", count


def candidate_count_for(p, lattice_steps, low, high, settings):
    """Candidate count (before duplicate merging) without building them."""
    return _candidate_plan(p, lattice_steps, low, high, settings)[1]


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
    point weighs continuous_volume · Π lattice_sizes / K.
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
    cumulative = torch.cumsum(torch.gather(q, 1, order), dim=1)
    cumulative = cumulative / cumulative[:, -1:]  # exact 1 at the end, so level 1 is reachable
    level_t = torch.as_tensor(levels, dtype=torch.float64)
    reach = torch.searchsorted(cumulative, level_t.expand(n, -1).contiguous(), side="left")
    threshold = torch.gather(sorted_scores, 1, reach.clamp(max=count - 1))
    # Every tie at the cutoff joins: the region is the prefix of scores >= threshold.
    size = torch.searchsorted(-sorted_scores, -threshold, side="right")
    last = size - 1
    mass = torch.gather(cumulative, 1, last)
    lower = torch.empty(n, len(levels), points.shape[1], dtype=torch.float64)
    upper = torch.empty_like(lower)
    for j in range(points.shape[1]):
        column = points[:, j][order]
        lower[:, :, j] = torch.gather(torch.cummin(column, dim=1).values, 1, last)
        upper[:, :, j] = torch.gather(torch.cummax(column, dim=1).values, 1, last)
    return {
        "lower": lower, "upper": upper, "mass": mass, "threshold": threshold,
        "covered": truth_scores[:, None] >= threshold,
        "mode": points[order[:, 0]], "ess": ess, "log_normalizer": log_normalizer,
    }


def hld_summaries(scores, log_measure, points, truth_scores, levels):
    """Highest-density summaries per case as a dict of numpy arrays.

    q ∝ exp(score + log_measure). Candidates are ranked by score (density), and the
    region at level α is {score >= t} for the highest t whose region holds mass >= α,
    i.e. the smallest such region, with all ties at t included. Returns lower/upper
    (n, L, p) projected bounds, mass/threshold/covered (n, L), mode (n, p), ess (n,),
    log_normalizer (n,).
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


def coverage_metrics(summaries, truths, levels, names):
    """Per level: fraction of truths in the projected bounds per axis and mean, and joint coverage."""
    truths = np.asarray(truths, dtype=np.float64)
    result = {}
    for i, level in enumerate(_check_levels(levels)):
        inside = (summaries["lower"][:, i] <= truths) & (truths <= summaries["upper"][:, i])
        per_axis = {name: _mean(inside[:, j]) for j, name in enumerate(names)}
        result[level_key(level)] = {
            "nominal": float(level), "per_axis": per_axis, "mean": _mean(inside.mean(axis=1)) if inside.size else None,
            "joint": _mean(summaries["covered"][:, i]),
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


def resolution_metrics(summaries, candidate_count, levels):
    """Candidate count, ESS spread, mean attained mass per level, and a low-resolution warning."""
    ess = np.asarray(summaries["ess"], dtype=np.float64)
    median = finite_or_none(np.median(ess)) if ess.size else None
    attained, problems = {}, []
    for i, level in enumerate(_check_levels(levels)):
        mass = _mean(summaries["mass"][:, i])
        attained[level_key(level)] = mass
        if mass is not None and mass > level + 0.05:
            problems.append(f"mean attained mass {mass:.3f} exceeds level {level:g} by more than 0.05")
    if median is not None and median < 10:
        problems.insert(0, f"median ESS {median:.1f} is below 10")
    warning = None
    if problems:
        warning = ("low candidate resolution: " + "; ".join(problems)
                   + "; raise candidate_count or candidate_points_per_axis")
    return {
        "candidate_count": int(candidate_count),
        "ess_min": finite_or_none(ess.min()) if ess.size else None,
        "ess_median": median,
        "ess_median_fraction": finite_or_none(median / candidate_count) if median is not None and candidate_count else None,
        "attained_mass": attained,
        "warning": warning,
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
