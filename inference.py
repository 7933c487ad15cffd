"""Inference analysis: truths, observation ensembles, candidate designs, ensemble and exact
scores of blocks of cases, highest-density (HPD) summaries and the bias/coverage/width/
resolution metrics; how the analysis sizes its work on a device (call_policy). The adaptive
design's refinement is adaptive.py.

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
    then refines it on its own, in blocks of cases (see adaptive.refine_block).
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

class CallPolicy(NamedTuple):
    """How the analysis sizes its work on a device: rows per network call, bytes per block of cases."""
    rows_per_call: int
    block_bytes: int


CPU_BLOCK_BYTES = 256 << 20     # a block of cases' refinement arrays on the host
CUDA_MEMORY_SHARE = 0.25        # of the free device memory: a network call's activations, and a block's arrays
CUDA_MAX_ROWS = 1 << 24         # the most rows of one network call on CUDA
# ensemble_scores builds the rows of several network calls at once (several of EVAL_BLOCK_ROWS on
# the CPU), in the slots of one buffer that walk through the calls side by side (slot j holds calls
# j·S, j·S + 1, ...): a slot keeps its case's observations from call to call, the points of all
# slots are one copy, and nothing but the network runs between the calls. On the CPU each small
# operation between two calls took about 100 µs, a few hundred rows' time.
CALL_GROUP_BYTES = 4 << 20


def call_policy(device_type, chunk_rows, row_bytes=1024, free_bytes=None):
    """Rows per network call and the bytes a block of cases may use, for a device type.

    On the CPU a call holds EVAL_BLOCK_ROWS rows, whose activations stay in cache. On
    CUDA a call holds as many rows as a share of the free memory allows at `row_bytes`
    each, up to 2^24 (about 9.5 million for the bundled network at d = 6 with 80 GB free); `free_bytes`
    defaults to what the device reports. chunk_rows caps the rows of a call on every device.
    """
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    if device_type != "cuda":
        return CallPolicy(min(EVAL_BLOCK_ROWS, int(chunk_rows)), CPU_BLOCK_BYTES)
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info()[0]
    budget = int(CUDA_MEMORY_SHARE * free_bytes)
    rows = min(max(budget // max(int(row_bytes), 1), ROW_PAD), CUDA_MAX_ROWS)
    return CallPolicy(min(rows, int(chunk_rows)), budget)


def network_row_bytes(model, input_width):
    """Bytes one row of a network call takes at its widest: the input, and two float32 activations of
    every layer the network has (a generous bound for an MLP or residual net)."""
    widths = [module.out_features for module in model.modules() if isinstance(module, torch.nn.Linear)]
    return 4 * (input_width + 2 * sum(widths)) if widths else 4096


def cases_per_block(cases, case_bytes, block_bytes):
    """Cases refined together: as many as fit into block_bytes at case_bytes each (at least one)."""
    return max(1, min(int(cases), int(block_bytes) // max(int(case_bytes), 1)))


def _call_layout(m, cases, n, rows_per_call):
    """How ensemble_scores cuts `cases` cases of n candidates (m rows each) into network calls of at
    most rows_per_call rows: (block, span, together).

    Every call holds `block` candidate slots of one case or of `together` whole cases, so each
    call's observations are one broadcast copy. A case of at least a call's worth of candidates
    takes calls of its own, evenly filled (span = their slots, n and a little padding);
    smaller cases share calls whole, as few calls as fit, evenly filled (span = n, together ≥ 1).
    """
    largest = max(1, min(int(rows_per_call) // m, cases * n))
    if n >= largest:
        per_case = -(-n // largest)
        block = -(-n // per_case)
        return block, per_case * block, 0
    calls = -(-cases // (largest // n))
    together = -(-cases // calls)
    return together * n, n, together


class Evaluations:
    """What a product's network calls did: rows evaluated, rows the calls held (padding too), calls."""

    def __init__(self):
        self.rows = self.call_rows = self.calls = 0

    def add(self, rows, call_rows, calls=1):
        """Count `calls` calls of call_rows rows in all, `rows` of them real."""
        self.rows += rows
        self.call_rows += call_rows
        self.calls += calls


def accepts_column_rows(logit_fn, width, device):
    """Whether logit_fn gives the same logits for rows held column by column (the transpose of a
    (width, rows) buffer) as for the same rows made contiguous: a network that reshapes its input
    with `view`, or whose arithmetic depends on the layout, is given contiguous rows instead."""
    buffer = torch.randn(width, 2 * ROW_PAD, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        try:
            return bool(torch.equal(logit_fn(buffer.T).reshape(-1), logit_fn(buffer.T.contiguous()).reshape(-1)))
        except Exception:     # whatever the network objects to, contiguous rows are what it was always given
            return False


def ensemble_scores(logit_fn, observations, points, rows_per_call, counted=None, column_rows=True):
    """S(θ) = Σ_k logit(x_k, θ) of every case's candidates: observations (B, m, d), points (B, n, p)
    -> (B, n) float64 on the observations' device. A single case's (m, d) and (n, p) give (n,).

    Each network call holds whole candidates (all m observations) of one case, or of several
    whole cases (see _call_layout), observation by observation ([x_1, θ] for every candidate
    of the call, then [x_2, θ], ...), in a (d + p, rows) buffer padded to a multiple of ROW_PAD
    and built a few calls at a time (see CALL_GROUP_BYTES). logit_fn sees a call's rows as the
    buffer's transpose, (rows, d + p) column by column (a contiguous copy with
    column_rows=False, see accepts_column_rows), and must return one new logit per row each
    call: they are summed after the group. Every row is computed on its own, so a case's scores
    do not depend on the other cases of its block, and on the CPU they are bitwise the same for
    every rows_per_call from EVAL_BLOCK_ROWS up. `counted` (an Evaluations) counts the calls.
    """
    if observations.dim() == 2:
        return ensemble_scores(logit_fn, observations[None], points[None], rows_per_call, counted, column_rows)[0]
    beside = observations.to(torch.float32).permute(0, 2, 1)[..., None]    # each case's (d, m, 1), a copy source
    (cases, d, m, _), (_, n, p) = beside.shape, points.shape
    block, span, together = _call_layout(m, cases, n, rows_per_call)
    count = cases * span                        # candidate slots: each case's n and its padding
    calls, width = -(-count // block), -(-block * m // ROW_PAD) * ROW_PAD
    group = max(1, min(calls, CALL_GROUP_BYTES // (4 * (d + p) * width)))
    stride = -(-calls // group)                 # slot j of the g-th group holds call j·stride + g
    theta = torch.zeros(p, group * stride * block, dtype=torch.float32, device=beside.device)
    theta[:, :count].view(p, cases, span)[:, :, :n].copy_(points.permute(2, 0, 1))   # each coordinate a row
    buffer = torch.zeros(d + p, group, width, dtype=torch.float32, device=beside.device)
    slots = buffer.view(d + p, group * width).T.split(width)
    scores = torch.empty(stride, group, block, dtype=torch.float64, device=beside.device)
    # Every view the loop uses is taken here: between network calls each operation is slow (see
    # CALL_GROUP_BYTES), so a group of calls takes one copy of its θ, one stack and one sum.
    thetas = buffer[d:, :, :block * m].view(p, group, m, block)
    sources = theta.view(p, group, stride, 1, block).unbind(2)              # each group's θ, (p, group, 1, block)
    observed = buffer[:d, :, :block * m].view(d, group, m, block).unbind(1)  # each slot's observations
    held = [None] * group                       # the first case whose observations fill a slot
    with torch.no_grad():
        for g, (source, summed) in enumerate(zip(sources, scores)):
            k = min(group, -(-(calls - g) // stride))     # the slots with a call in this group
            _refresh_observations(observed, held, beside, [(j * stride + g) * block // span for j in range(k)],
                                  together)
            thetas.copy_(source)                          # slots past k compute nothing that is kept
            _sum_logits(torch.stack([logit_fn(slots[j] if column_rows else slots[j].contiguous()) for j in range(k)]),
                        width, m, summed[:k])
    if counted is not None:
        counted.add(cases * n * m, calls * width, calls)
    return scores.transpose(0, 1).reshape(-1)[:count].view(cases, span)[:, :n]


def _sum_logits(logits, width, m, out):
    """Sum each call's logits (a group's, stacked) over its candidates' m observations, in float64, into
    out (calls, candidates); a network that gives other than one logit per row is refused."""
    calls, block = out.shape
    if logits.numel() != calls * width:
        raise ValueError(f"the network gave logits of shape {tuple(logits.shape[1:])} for {width} rows; it must "
                         "give one logit per row")
    torch.sum(logits.as_strided((calls, m, block), (width, block, 1)).double(), dim=1, out=out)


def _refresh_observations(observed, held, beside, firsts, together):
    """Give slot j (observed[j], (d, m, block)) the observations of its call, whose first case is
    firsts[j] (see _fill_observations), unless it holds them already; held[j], the first case
    of the call whose observations slot j holds, is kept up to date."""
    for j, first in enumerate(firsts):
        if held[j] != first:
            _fill_observations(observed[j], beside, first, together)
            held[j] = first


def _fill_observations(observed, beside, first, together):
    """Put the observations of a call's cases beside its candidates, in observed (d, m, block):
    case `first`'s alone (together = 0), or `together` whole cases from `first` on (fewer at the
    end), each beside its own n = block / together candidates. beside (B, d, m, 1) is the
    observations x (B, m, d) as x.permute(0, 2, 1)[..., None]. One broadcast copy either way."""
    if not together:
        observed.copy_(beside[first])
        return
    d, m, block = observed.shape
    cases = beside[first:first + together]
    observed.view(d, m, together, block // together)[:, :, :cases.shape[0]].copy_(cases.permute(1, 2, 0, 3))


def exact_scores(log_likelihood, observations, points, chunk_rows=EVAL_BLOCK_ROWS):
    """Σ_k log p(x_k | θ) of every case's candidates, with `log_likelihood(x (c, m, d), θ (c, 1, p)) -> (c, m)`
    broadcasting: observations (B, m, d), points (B, n, p) -> (B, n) float64 on the observations'
    device; a single case's (m, d) and (n, p) give (n,). Each candidate's sum depends on its own
    rows alone, whatever chunk_rows is."""
    if observations.dim() == 2:
        return exact_scores(log_likelihood, observations[None], points[None], chunk_rows)[0]
    (cases, m, _), (_, n, p) = observations.shape, points.shape
    theta = points.to(observations.device).reshape(cases * n, 1, p)
    owner = torch.arange(cases, device=observations.device).repeat_interleave(n)
    block = max(1, int(chunk_rows) // m)
    scores = torch.empty(cases * n, dtype=torch.float64, device=observations.device)
    with torch.no_grad():
        for start in range(0, cases * n, block):
            chunk = theta[start:start + block]
            values = log_likelihood(observations[owner[start:start + block]], chunk).reshape(chunk.shape[0], m)
            scores[start:start + chunk.shape[0]] = values.to(torch.float64).sum(dim=1)
    return scores.reshape(cases, n)


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


def _mass_above(ascending, cumulative, values, side):
    """Per case, the normalised mass of the candidates denser than its value ("left") or as dense
    ("right"); ascending (B, K) holds the candidates' scores, negated, from the densest down."""
    count = torch.searchsorted(ascending, -values[:, None], side=side)
    mass = torch.gather(cumulative, 1, (count - 1).clamp(min=0))[:, 0]
    return torch.where(count[:, 0] > 0, mass, torch.zeros_like(mass))


def region_bounds(columns, scores, threshold):
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


def point_columns(points):
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


def summarise_block(scores, log_measure, points, truth_scores, levels):
    """HPD summaries of a block of cases as tensors on the scores' device (see hld_summaries).

    scores (B, K); log_measure (K,) and points (K, p) shared by the cases, or each
    case's own, (B, K) and (B, K, p).
    """
    return weighted_summary(scores, log_measure, points, truth_scores, levels)[0]


def weighted_summary(scores, log_measure, points, truth_scores, levels, other=None):
    """summarise_block's summaries, the normalised weights q (B, K) of the candidates and their
    ranking: density order (B, K) and the levels' region sizes (B, L). `other`, another target's
    summary and ranking on the same points: its order is used where it orders these scores
    too, and its bounds where every region holds the same points."""
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
    ascending = sorted_scores.neg()                 # for searchsorted, which looks up ascending rows
    size = torch.searchsorted(ascending, -threshold, side="right")
    last = size - 1
    mass = torch.gather(cumulative, 1, last)
    # Kish ESS of the points inside the widest region: how well that region is resolved.
    widest = last[:, int(np.argmax(levels))][:, None]
    region_ess = (torch.gather(running, 1, widest) ** 2
                  / torch.gather(torch.cumsum(sorted_q.mul_(sorted_q), dim=1), 1, widest))[:, 0]
    # The truth's credibility: the mass of the candidates denser than the truth. The truth is
    # in the region of level α exactly when its credibility is below α (as `covered` says).
    # With its ties (such as its own lattice point) the mass reaches credibility_upper.
    credibility = _mass_above(ascending, cumulative, truth_scores, "left")
    credibility_upper = _mass_above(ascending, cumulative, truth_scores, "right")
    lower, upper = _bounds(columns, scores, threshold, (order, size), other)
    summary = {
        "lower": lower, "upper": upper, "mass": mass, "threshold": threshold,
        "covered": truth_scores[:, None] >= threshold,
        "mode": points[torch.arange(n, device=scores.device), scores.argmax(dim=1)],   # the first among ties
        "ess": ess,
        "log_normalizer": log_normalizer, "region_ess": region_ess,
        "credibility": credibility, "credibility_upper": credibility_upper,
    }
    return summary, q, (order, size)


def _bounds(columns, scores, threshold, ranking, other):
    """region_bounds, or those of another target (its summary and ranking) where every region is the
    same prefix of one density order: the same points."""
    if other is not None and ranking[0] is other[1][0] and torch.equal(ranking[1], other[1][1]):
        return other[0]["lower"], other[0]["upper"]
    return region_bounds(columns, scores, threshold)


def host_summary(summary):
    """A block's summaries as numpy arrays on the host."""
    return {key: value.cpu().numpy() for key, value in summary.items()}


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
    parts = [host_summary(summarise_block(scores[i:i + step], log_measure, points, truth_scores[i:i + step], levels))
             for i in range(0, scores.shape[0], step)]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


# ---------------------------------------------------------------------------
# Adaptive candidates: their sizes (adaptive.py refines them)
# ---------------------------------------------------------------------------

PROBE_RADII = 16     # first probe round: evenly spaced radii along each ray
PROBE_REFINE = 16    # second round, per ray: points inside the brackets where the levels' regions end


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

def effective_sizes(log_weights):
    """Kish's effective sample size (Σw)²/Σw² of weights given as logs, over the last axis."""
    return torch.exp(2 * torch.logsumexp(log_weights, -1) - torch.logsumexp(2 * log_weights, -1))


def effective_sample_size(log_weights):
    """The effective sample size of one set of weights given as logs, as a JSON number."""
    return finite_or_none(effective_sizes(torch.as_tensor(log_weights, dtype=torch.float64)))


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
