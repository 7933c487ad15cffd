"""Adaptive candidates: a shared coarse pass, then refined passes and probes for a block of cases at once.

Every case of a block draws the same number of points in each pass, so the whole
refinement is a set of tensors with the block as their first axis, on the device the
cases' scores come from. A case's results do not depend on the block it is refined in:
every step works on each case's own rows, its refined passes draw from its own Sobol
stream (see case_seed), and network calls see each row alone (see case_scores.ensemble_scores).

One case, in order (refine_block):
1. the coarse design (shared) and the truth are scored;
2. each refined pass fits, per target and on that target's own scores (never the
   truth), a product of truncated normals with the density's mean and inflated sd
   (fit_proposals); lattice axes take the mass of each lattice point's cell, so they
   keep counting measure;
3. the points of all passes, coarse included, carry deterministic-mixture importance
   weights, summed over repeated lattice points (the repeats keep their place at zero
   weight) and scaled to the box's measure exactly;
4. zero-measure probes along rays from each density's mean sharpen the projected
   bounds: they change no mass, threshold or coverage, only where a region is seen to end.
"""

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

import designs
import hpd

__all__ = [
    "Box",
    "Proposal",
    "Refinement",
    "case_seed",
    "draw_proposals",
    "fit_proposals",
    "mixture_log_terms",
    "proposal_log_density",
    "refine_block",
    "stack_proposals",
    "support_box",
]

INFLATION = 1.5  # a refined proposal's sd over the density's estimated sd: wide enough not to clip it
REACH = 4.0  # a refined box spans the proposal mean ± REACH proposal sds (and the modes found)
MAX_SHRINK = 4.0  # a pass narrows the previous spread at most this much: few effective points mislead
PROBE_REACH = 1.5  # rays reach this multiple of the farthest region point's Mahalanobis radius


class Box(NamedTuple):
    """The prior's support: bounds (p,) (lattice axes: first and last lattice point) and steps."""

    low: torch.Tensor
    high: torch.Tensor
    lattice: torch.Tensor  # bool (p,)
    step: torch.Tensor  # the lattice step, 1 on continuous axes

    def to(self, device):
        """The same box with its tensors on `device`."""
        return Box(*(field.to(device) for field in self))

    def half_cell(self):
        """Half a lattice step on lattice axes, 0 elsewhere: a lattice point's cell reaches this far."""
        return torch.where(self.lattice, self.step / 2, torch.zeros_like(self.step))

    def log_measure(self):
        """Log of the box's measure: Lebesgue on continuous axes, counting on lattice axes."""
        counts = torch.round((self.high - self.low) / self.step) + 1
        return float(torch.where(self.lattice, counts, self.high - self.low).log().sum())

    def snap(self, values, low=None, high=None, out=None):
        """Values clamped into [low, high] (the box by default), lattice axes rounded onto the lattice
        (written into `out` if given)."""
        low = self.low if low is None else low
        high = self.high if high is None else high
        if bool(self.lattice.any()):
            on_lattice = self.low + torch.round((values - self.low) / self.step) * self.step
            values = torch.where(self.lattice, on_lattice, values)
        return torch.clamp(values, low, high, out=out)


def support_box(low, high, lattice_steps):
    """The Box of a prior's support; lattice axes end on their last lattice point."""
    low, high = designs.as_f64(low), designs.as_f64(high)
    designs.check_box(low, high)
    lattice = torch.tensor([s is not None for s in lattice_steps])
    step = torch.tensor([1.0 if s is None else float(s) for s in lattice_steps], dtype=torch.float64)
    last = torch.tensor(
        [
            float(designs.lattice_support(a, b, s)[-1]) if s is not None else b
            for a, b, s in zip(low.tolist(), high.tolist(), lattice_steps)
        ],
        dtype=torch.float64,
    )
    return Box(low, last, lattice, step)


class Refinement(NamedTuple):
    """What refine_block needs besides the cases: the prior's support box, the levels summarised,
    the passes' sizes (designs.adaptive_sizes) and the seed of the cases' streams (see case_seed)."""

    box: Box
    levels: Sequence[float]
    sizes: Mapping[str, Any] | None  # None: a fixed design, nothing to refine
    seed: int


class Proposal(NamedTuple):
    """Products of normals truncated to boxes [low, high], one per case (fields (B, p)); a lattice
    point takes its cell's mass. Stacked proposals have fields (B, C, p) and counts (C,)."""

    mean: torch.Tensor
    sd: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    # points drawn from it per case, a list of one per proposal when stacked (shadows tuple.count)
    count: Any

    def mapped(self, change: Callable[[torch.Tensor], torch.Tensor]) -> "Proposal":
        """This proposal with change(field) for each of its four tensor fields, its count kept."""
        return Proposal(change(self.mean), change(self.sd), change(self.low), change(self.high), self.count)


def _log1mexp(x):
    """log(1 − exp(x)) for x <= 0, accurate on both sides of −log 2."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _log_normal_interval(a, b):
    """log(Φ(b) − Φ(a)) for a <= b, accurate in both tails."""
    upper = a > 0  # both in the upper tail: mirror into the lower one, where Φ keeps its digits
    a, b = torch.where(upper, -b, a), torch.where(upper, -a, b)
    log_b = torch.special.log_ndtr(b)
    return log_b + _log1mexp(torch.special.log_ndtr(a) - log_b)


def _standard_z(proposal, box):
    """The proposal's support [low, high] (lattice cells included) in standard units."""
    half = box.half_cell()
    return (proposal.low - half - proposal.mean) / proposal.sd, (proposal.high + half - proposal.mean) / proposal.sd


def draw_proposals(proposal, unit, box, out=None):
    """Map unit-cube points (B, n, p) through each case's truncated normals' inverse CDF; lattice axes
    snap (the points are written into `out` if given)."""
    proposal = proposal.mapped(lambda field: field[:, None])
    za, zb = _standard_z(proposal, box)
    pa, pb = torch.special.ndtr(za), torch.special.ndtr(zb)
    z = torch.special.ndtri(torch.addcmul(pa, unit, pb - pa))
    return box.snap(torch.addcmul(proposal.mean, proposal.sd, z.clamp_(za, zb)), proposal.low, proposal.high, out)


def _log_normalisers(proposals, box):
    """Each stacked proposal's log normaliser (B, C): its log density at its mean is at most minus this."""
    sd = proposals.sd[..., ~box.lattice]
    za, zb = _standard_z(proposals, box)
    return (
        torch.log(sd).sum(dim=2) + 0.5 * sd.shape[2] * math.log(2 * math.pi) + _log_normal_interval(za, zb).sum(dim=2)
    )


def proposal_log_density(proposals, points, box, offset=None, extremes=None):
    """Log density (B, C, n) of stacked proposals (fields (B, C, p)) at each case's points (B, n, p):
    Lebesgue × counting measure, −inf outside each proposal's box; `offset` (C,) or (B, C), if
    given, is added to each proposal's (its log count, say). `extremes`: the points' (see
    point_extremes), if known."""
    columns = hpd.point_columns(points)
    inside = _inside_boxes(columns, proposals.low, proposals.high, extremes)
    continuous = ~box.lattice
    everywhere = bool(continuous.all())  # no lattice axis: no column to pick out
    x = columns if everywhere else columns[:, continuous]
    mean = proposals.mean if everywhere else proposals.mean[..., continuous]
    sd = proposals.sd if everywhere else proposals.sd[..., continuous]
    inverse = sd**-2
    # Each proposal's log normaliser, less the offset: what every point's −½ quadratic loses.
    constant = _log_normalisers(proposals, box)
    constant = (constant if offset is None else constant - offset)[..., None]
    # −½ Σ_j (x_j − μ_j)²/σ_j² − constant of every point under every proposal at once, as two
    # batched matrix products (the constant terms start the sum).
    total = torch.baddbmm(-0.5 * (mean * mean * inverse).sum(dim=2, keepdim=True) - constant, -0.5 * inverse, x * x)
    total.baddbmm_(mean * inverse, x)
    if not everywhere:
        lattice_sd = proposals.sd[:, :, None, box.lattice]
        z = (points[:, None, :, box.lattice] - proposals.mean[:, :, None, box.lattice]) / lattice_sd
        cell = box.half_cell()[box.lattice] / lattice_sd
        total = total + _log_normal_interval(z - cell, z + cell).sum(dim=-1)
    return total if inside is None else total.masked_fill_(inside.logical_not_(), -math.inf)


def point_extremes(columns):
    """Each case's lowest and highest coordinates (B, p), (B, p) of its points held as columns (B, p, n)
    (NaN where a point has NaN)."""
    return columns.amin(dim=2), columns.amax(dim=2)


def _inside_boxes(columns, low, high, extremes=None):
    """Whether each case's points (columns (B, p, n)) lie in each of its boxes [low, high] (B, C, p):
    (B, C, n), or None where every point lies in every box.

    Only the sides some point of some case may cross (by the points' extremes, computed if not
    given) are compared: the early proposals' wide boxes, clipped to the prior's, usually hold
    every point of the later passes, and a comparison costs as much as the density's
    arithmetic (a NaN point is compared, and fails).
    """
    lowest, highest = point_extremes(columns) if extremes is None else extremes
    crossed = torch.stack([~(lowest[:, None, :] >= low), ~(highest[:, None, :] <= high)]).any(dim=(1, 2)).tolist()
    (cases, p, n), components = columns.shape, low.shape[1]
    inside = within = None
    for j in range(p):
        column = columns[:, j : j + 1, :]
        for side, (compare, bound) in enumerate(((torch.ge, low), (torch.le, high))):
            if not crossed[side][j]:
                continue
            if inside is None:
                inside = torch.ones(cases, components, n, dtype=torch.bool, device=columns.device)
                within = torch.empty_like(inside)  # every comparison written here, not a fresh array
            inside.logical_and_(compare(column, bound[:, :, j : j + 1], out=within))
    return inside


def stack_proposals(proposals):
    """Proposals stacked along a second axis (fields (B, C, p)), for proposal_log_density."""

    def stacked(name):
        return torch.stack([getattr(c, name) for c in proposals], dim=1)

    return Proposal(stacked("mean"), stacked("sd"), stacked("low"), stacked("high"), [c.count for c in proposals])


def mixture_log_terms(proposals, points, box, extremes=None):
    """log Σ_c n_c g_c(θ) (B, n) of stacked proposals (n_c points each) at each case's points.

    All points together are a sample of the mixture of the uniform coarse design and
    the refined proposals, so a point weighs 1/(n_u u(θ) + Σ_c n_c g_c(θ)): the
    deterministic-mixture rule, unbiased for the box's measure. Each pass adds its
    proposals' terms to the points' running denominator (see _refined_passes). `extremes`:
    the points' (see point_extremes), if known.
    """
    log_counts = torch.tensor(proposals.count, dtype=torch.float64, device=points.device).log()
    # A log-sum-exp over the proposals, shifted by the highest of their peaks (each at its mean):
    # no term exceeds it, so none overflows, and no pass over the terms looks for their maximum.
    # A term more than ~745 below it underflows to nothing, far below the uniform design's term
    # that every denominator holds too.
    peak = (log_counts - _log_normalisers(proposals, box)).amax(dim=1)
    terms = proposal_log_density(proposals, points, box, log_counts - peak[:, None], extremes)
    return terms.exp_().sum(dim=1).log_().add_(peak[:, None])


def _log_weights(log_denominator, multiplicity):
    """Importance weights (B, n), as logs, from the mixture's denominators; coarse points merged on
    a lattice (first) weigh their multiplicity (log given) times that."""
    log_weights = -log_denominator
    log_weights[:, : multiplicity.numel()] += multiplicity
    return log_weights


def weighted_moments(columns, q):
    """Mean (B, p) and covariance (B, p, p) of each case's points, held as columns (B, p, n), under
    normalised weights q (B, n), and the points' offsets from the mean, each scaled by √q (B, p, n)."""
    mean = torch.bmm(q[:, None, :], columns.transpose(1, 2))[:, 0]
    # The covariance is the scaled offsets' product with themselves.
    scaled = (columns - mean[:, :, None]).mul_(q.sqrt()[:, None, :])
    return mean, torch.bmm(scaled, scaled.transpose(1, 2)), scaled


def fit_proposals(points, log_q, spread, box, anchors, count):
    """Each case's next proposal for a density given by weights exp(log_q) on its points.

    Its sd is the density's, inflated, but at least spread / MAX_SHRINK (the previous
    spread: estimates from few effective points are too narrow). Its box reaches REACH
    sds either side of the mean and always holds the anchors (B, a, p), the modes found so far.
    """
    q = torch.softmax(log_q, dim=1)
    mean, covariance, _ = weighted_moments(hpd.point_columns(points), q)
    floor = torch.where(box.lattice, box.step / 2, (box.high - box.low) * 1e-9)
    # Few effective points place the mean roughly and see too little of the tails: widen more
    # (1/√ESS = √Σq², Kish's effective size of normalised weights).
    inflation = INFLATION * (1 + (q * q).sum(dim=1).sqrt())[:, None]
    sd = torch.maximum(
        torch.maximum(inflation * covariance.diagonal(dim1=1, dim2=2).sqrt(), spread / MAX_SHRINK), floor
    )
    low = torch.maximum(torch.minimum(mean - REACH * sd, anchors.amin(dim=1)), box.low)
    high = torch.minimum(torch.maximum(mean + REACH * sd, anchors.amax(dim=1)), box.high)
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


def _rows_at(values, index):
    """values[b, index[b]] for every case b: (B, n, p), (B,) -> (B, p)."""
    return values[torch.arange(values.shape[0], device=values.device), index]


SOBOL_BITS = 30  # torch's SobolEngine.MAXBIT: its directions and points are 30-bit integers


def _case_draws(seeds, count, p, device):
    """The first `count` points of each case's own scrambled Sobol stream (one seed per case),
    (B, count, p) on `device`, held as columns: bitwise what
    torch.quasirandom.SobolEngine(p, scramble=True, seed=seed).draw(count, dtype=torch.float64)
    gives, drawn for every case at once (64 engines a block cost more than the whole draw).

    A stream's scramble, as the engine makes it: a random shift and random lower-triangular
    bit matrices L_d (unit diagonal) from a generator seeded with its seed; bit 29 − q of
    direction j of dimension d is the parity of the bits that row q of L_d shares with the
    plain direction. Its point i is shift ^ (the directions of the bits set in gray(i)) over
    2^30, the first one rounded as the engine rounds it (in the default dtype).
    """
    base = torch.quasirandom.SobolEngine(p).sobolstate  # (p, 30), unscrambled
    shift_bits, rows = [], []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        shift_bits.append(torch.randint(2, (p, SOBOL_BITS), generator=generator))
        rows.append(torch.randint(2, (p, SOBOL_BITS, SOBOL_BITS), generator=generator))
    powers = torch.pow(2, torch.arange(SOBOL_BITS))  # bit k is worth 2^k
    shift = (torch.stack(shift_bits) * powers).sum(dim=-1)  # (B, p)
    matrices = torch.stack(rows).tril_()
    matrices.diagonal(0, -2, -1).fill_(1)
    row_values = (matrices * powers.flip(0)).sum(dim=-1)  # (B, p, 30): row q, bit 29 − k for column k
    parity = row_values[:, :, None, :] & base[None, :, :, None]  # (B, p, 30 directions, 30 rows)
    for half in (16, 8, 4, 2, 1):
        parity ^= parity >> half
    directions = ((parity & 1) * powers.flip(0)).sum(dim=-1)  # (B, p, 30)
    # In Gray-code order, gray(2^k + i) = gray(i) ^ 2^k ^ 2^(k−1) for i < 2^k: each block of points
    # is the one before it with two directions flipped (one for the first block).
    flips = directions.clone()
    flips[:, :, 1:] ^= directions[:, :, :-1]
    # Each point x/2^30 exactly, with no conversion pass: a 30-bit integer x is the low bits of the
    # mantissa of 2^22 + x/2^30, a double whose high bits the directions never flip.
    state = torch.empty(len(seeds), p, count, dtype=torch.int64)
    state[:, :, 0] = shift | 0x4150000000000000
    size, k = 1, 0
    while size < count:
        step = min(size, count - size)
        torch.bitwise_xor(state[:, :, :step], flips[:, :, k : k + 1], out=state[:, :, size : size + step])
        size, k = size + step, k + 1
    points = state.view(torch.float64).sub_(2.0**22)
    points[:, :, 0] = (shift / 2**SOBOL_BITS).to(torch.float64)
    return points.to(device).transpose(1, 2)


def _draw_pass(columns, start, proposals, units, box):
    """Draw each proposal's points, from its share of a pass's unit points (B, n, p), into the
    columns (B, p, N) from `start` on; returns where they end."""
    for proposal, unit in zip(proposals, units.split([c.count for c in proposals], dim=1)):
        draw_proposals(proposal, unit, box, out=columns[:, :, start : start + proposal.count].transpose(1, 2))
        start += proposal.count
    return start


def _fit_targets(points, scores, log_weights, anchors, spread, box, size):
    """Each target's next proposal, fitted on its scores {target: (B, n)} at the points so far under
    the mixture weights, to draw its share of the pass's `size` points; spread[target] becomes
    the proposal's sd."""
    fitted = {}
    for target, share in zip(scores, _shares(size, len(scores))):
        best = _rows_at(points, scores[target].argmax(dim=1))
        fitted[target] = fit_proposals(
            points,
            scores[target] + log_weights,
            spread[target],
            box,
            torch.stack([anchors[target], best], dim=1),
            share,
        )
        spread[target] = fitted[target].sd
    return fitted


class Refined(NamedTuple):
    """What the refined passes leave: the mixture weights (B, n) of the n points measured (coarse and
    refined), each target's last proposal and the points' extremes (see point_extremes)."""

    log_weights: torch.Tensor
    last: dict
    extremes: tuple


def _refined_passes(score_fn, columns, scores, multiplicity, box, sizes, seeds):
    """Run the refined passes (a Refined): each target fits its next proposal on its own weighted scores.

    columns (B, p, N) holds the coarse points first and scores {target: (B, N)} their
    scores; each pass writes its points and scores after them, so nothing grows by copying.
    """
    targets, cases = list(scores), len(seeds)
    filled = sizes["coarse_points"]
    # Points are held as columns, each coordinate a contiguous row, and used through their
    # (B, n, p) view: elementwise work and comparisons then run along those rows.
    points = columns[:, :, :filled].transpose(1, 2)
    anchors = {t: _rows_at(points, scores[t][:, :filled].argmax(dim=1)) for t in targets}  # the coarse modes
    uniform_sd = (box.high - box.low + 2 * box.half_cell()) / math.sqrt(12)
    spread = {t: uniform_sd.expand(cases, -1) for t in targets}
    components, extremes = [], point_extremes(columns[:, :, :filled])
    uniform = torch.tensor(math.log(sizes["coarse"]) - box.log_measure(), dtype=torch.float64, device=points.device)
    log_denominator = uniform.expand(cases, filled + sum(sizes["passes"])).clone()
    # Every pass's unit points at once: one draw per case, split between the passes in order.
    units = _case_draws(seeds, sum(sizes["passes"]), points.shape[2], points.device).split(sizes["passes"], dim=1)
    for size, pass_units in zip(sizes["passes"], units):
        last = _fit_targets(
            points,
            {t: s[:, :filled] for t, s in scores.items()},
            _log_weights(log_denominator[:, :filled], multiplicity),
            anchors,
            spread,
            box,
            size,
        )
        fitted = list(last.values())
        start = _draw_pass(columns, filled, fitted, pass_units, box)
        fresh = columns[:, :, filled:start].transpose(1, 2)
        fresh_scores, fresh_extremes = score_fn(fresh), point_extremes(columns[:, :, filled:start])
        # Earlier points gain the new proposals' terms; fresh points take every proposal's.
        components += fitted
        earlier = log_denominator[:, :filled]
        torch.logaddexp(earlier, mixture_log_terms(stack_proposals(fitted), points, box, extremes), out=earlier)
        torch.logaddexp(
            uniform,
            mixture_log_terms(stack_proposals(components), fresh, box, fresh_extremes),
            out=log_denominator[:, filled:start],
        )
        for target in targets:
            scores[target][:, filled:start] = fresh_scores[target]
        extremes = (torch.minimum(extremes[0], fresh_extremes[0]), torch.maximum(extremes[1], fresh_extremes[1]))
        filled = start
        points = columns[:, :, :filled].transpose(1, 2)
    return Refined(_log_weights(log_denominator, multiplicity), last, extremes)


def _merged(points, log_weights, box):
    """Sum the weights of repeated lattice points into their first occurrence (the repeats keep
    their place at −inf), then scale each case's weights to the box's measure."""
    if bool(box.lattice.any()):
        cases, n, p = points.shape
        case = torch.arange(cases, dtype=points.dtype, device=points.device).repeat_interleave(n)
        _, group = torch.unique(torch.cat([case[:, None], points.reshape(-1, p)], dim=1), dim=0, return_inverse=True)
        flat = log_weights.reshape(-1)
        position = torch.arange(flat.numel(), device=flat.device)
        first = torch.full((int(group.max()) + 1,), flat.numel(), device=flat.device).scatter_reduce(
            0, group, position, "amin"
        )
        peak = torch.full(first.shape, -math.inf, dtype=flat.dtype, device=flat.device).scatter_reduce(
            0, group, flat, "amax"
        )
        finite_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        total = torch.zeros_like(peak).index_add_(0, group, torch.exp(flat - finite_peak[group]))
        merged = torch.full_like(flat, -math.inf)
        merged[first] = finite_peak + total.log()
        log_weights = merged.reshape(cases, n)
    # The mixture rule integrates the box's measure without bias; rescaling makes it exact and
    # leaves every normalised density unchanged.
    return log_weights + (box.log_measure() - torch.logsumexp(log_weights, dim=1, keepdim=True))


def _ray_frame(scaled, q, scores, covariance, origin, threshold, box):
    """Rays (B, 2p, p) from each origin along ±Σe_j/√Σ_jj, where an ellipsoid's extent along axis j
    lies, and their ends (B, 2p); scaled (B, p, n) are the points' offsets from the origin,
    each times the square root of its weight q (B, n), as weighted_moments gives them.

    Σ is the density's covariance. A ray ends at PROBE_REACH times the farthest
    Mahalanobis radius of the widest region's points (of positive weight: a point whose
    weight underflowed has no radius here), or where it leaves the box.
    """
    floor = torch.where(box.lattice, box.step / 2, (box.high - box.low) * 1e-6)
    covariance = covariance + torch.diag(floor * floor)
    directions = covariance / covariance.diagonal(dim1=1, dim2=2).sqrt()[:, :, None]
    rays = torch.cat([directions, -directions], dim=1)
    # Whitened offsets L⁻¹(θ − origin)√q, Σ = LLᵀ: one small inverse, then one batched product.
    identity = torch.eye(covariance.shape[1], dtype=covariance.dtype, device=covariance.device)
    whitening = torch.linalg.solve_triangular(
        torch.linalg.cholesky(covariance), identity.expand_as(covariance), upper=False
    )
    whitened = torch.bmm(whitening, scaled)
    squared = whitened.mul_(whitened).sum(dim=1)  # each point's radius², times its weight
    counted = (scores >= threshold[:, None]) & (q > 0)
    farthest = torch.where(counted, squared / q, 0.0).amax(dim=1).sqrt()
    reach = PROBE_REACH * farthest.clamp(min=1.0)
    safe = torch.where(rays == 0, torch.ones_like(rays), rays)
    exits = torch.where(
        rays > 0,
        (box.high - origin[:, None, :]) / safe,
        torch.where(rays < 0, (box.low - origin[:, None, :]) / safe, torch.full_like(rays, math.inf)),
    )
    ends = torch.minimum(exits.amin(dim=2).clamp(min=0.0), reach[:, None])
    return rays, ends


def _ray_points(origin, rays, radii, box):
    """Points origin + t·ray for radii (B, rays, n), snapped into the box, shape (B, rays · n, p)."""
    points = origin[:, None, None, :] + radii[..., None] * rays[:, :, None, :]
    return box.snap(points.reshape(origin.shape[0], -1, origin.shape[1]))


def _bracket_radii(scores, radii, thresholds):
    """Second-round radii per ray (B, rays, PROBE_REFINE), shared among the levels' brackets.

    A level's bracket lies between the farthest first-round radius inside its region
    (0: the origin) and the next one; a ray inside throughout repeats its end.
    """
    cases, rays, count = radii.shape
    padded = torch.cat([torch.zeros(cases, rays, 1, dtype=radii.dtype, device=radii.device), radii], dim=2)
    position = torch.arange(1, count + 1, device=radii.device)
    parts = []
    for level, share in enumerate(_shares(designs.PROBE_REFINE, thresholds.shape[1])):
        inside = scores >= thresholds[:, level, None, None]
        last = (inside * position).amax(dim=2, keepdim=True)  # 0 when no radius is inside
        inner, outer = padded.gather(2, last), padded.gather(2, (last + 1).clamp(max=count))
        fraction = torch.arange(1, share + 1, dtype=radii.dtype, device=radii.device) / (share + 1)
        parts.append(inner + (outer - inner) * fraction)
    return torch.cat(parts, dim=2)


def _probe(score_fn, frames, box):
    """Two rounds of probes along every target's rays; returns the points (B, n, p) and every target's scores.

    frames: {target: (origin, rays, ends, thresholds)}. One call per round scores all
    targets' probes together.
    """
    steps = torch.arange(1, designs.PROBE_RADII + 1, dtype=torch.float64, device=box.low.device)
    first = {t: ends[..., None] * steps / designs.PROBE_RADII for t, (_, _, ends, _) in frames.items()}
    points = torch.cat([_ray_points(origin, rays, first[t], box) for t, (origin, rays, _, _) in frames.items()], dim=1)
    scores = score_fn(points)
    second, offset = {}, 0
    for target, (_, rays, _, thresholds) in frames.items():
        size = rays.shape[1] * designs.PROBE_RADII
        own = scores[target][:, offset : offset + size].reshape(-1, rays.shape[1], designs.PROBE_RADII)
        second[target] = _bracket_radii(own, first[target], thresholds)
        offset += size
    more = torch.cat([_ray_points(origin, rays, second[t], box) for t, (origin, rays, _, _) in frames.items()], dim=1)
    more_scores = score_fn(more)
    return torch.cat([points, more], dim=1), {t: torch.cat([scores[t], more_scores[t]], dim=1) for t in scores}


def _widen(summary, probes, probe_scores, best):
    """Extend each case's bounds by the probes inside each region, and its mode by a higher probe.

    Probes carry no measure: they sharpen where a region ends without changing its mass.
    """
    lowest, highest = hpd.region_bounds(hpd.point_columns(probes), probe_scores, summary["threshold"])
    summary["lower"] = torch.minimum(summary["lower"], lowest)
    summary["upper"] = torch.maximum(summary["upper"], highest)
    top, where = probe_scores.max(dim=1)
    higher = (top > best)[:, None]
    summary["mode"] = torch.where(higher, _rows_at(probes, where), summary["mode"])


def refinement_checks(columns, q, moments, proposal, box, extremes=None):
    """Edge mass and disagreement (B,) of each case's refined density (q (B, n): its normalised
    weights on the points, held as columns (B, p, n); moments: its mean and covariance) with the
    last proposal that placed it.

    Edge mass: the density's mass outside the last box shrunk by one proposal sd (not on
    sides where the box is the prior's). Disagreement: the larger of the largest mean
    shift over 2 proposal sds and the largest density sd over √2 proposal sds; above 1
    the earlier passes misjudged where the mass is, or importance weights may have
    infinite variance. `extremes`: the points' (see point_extremes), if known.
    """
    mean, covariance = moments
    inner_low = torch.where(proposal.low > box.low, proposal.low + proposal.sd, box.low)
    inner_high = torch.where(proposal.high < box.high, proposal.high - proposal.sd, box.high)
    inside = _inside_boxes(columns, inner_low[:, None], inner_high[:, None], extremes)
    edge_mass = q.new_zeros(q.shape[0]) if inside is None else torch.where(inside[:, 0], 0.0, q).sum(dim=1)
    shift = ((mean - proposal.mean).abs() / proposal.sd).amax(dim=1)
    spread = (covariance.diagonal(dim1=1, dim2=2).sqrt() / proposal.sd).amax(dim=1)
    return edge_mass, torch.maximum(shift / 2, spread / math.sqrt(2))


def _coarse_scores(score_fn, coarse_points, truths, cases):
    """Every target's scores on the coarse design and at each truth, in one call; unusable scores raise."""
    points = torch.cat([coarse_points.expand(truths.shape[0], -1, -1), truths[:, None, :]], dim=1)
    first = score_fn(points)
    for target, values in first.items():
        values = values[:, :-1]
        bad = ~torch.isfinite(values).any(dim=1) | torch.isnan(values).any(dim=1) | torch.isposinf(values).any(dim=1)
        if bool(bad.any()):
            raise ValueError(
                f"case {cases[int(torch.nonzero(bad)[0])]}: {target} scores on the coarse candidates "
                "are NaN, +inf or all -inf; check the network output or the likelihood for that case"
            )
    return {t: s[:, :-1] for t, s in first.items()}, {t: s[:, -1] for t, s in first.items()}


def _measured_summaries(points, refined, scores, truth_scores, levels, box):
    """Per target: the summary on the measured points (their weights and extremes in `refined`), with
    the refinement checks against the target's last proposal, and the probe frame."""
    log_weights, last, extremes = refined
    columns = hpd.point_columns(points)
    summaries, frames, other = {}, {}, None
    for target, values in scores.items():
        summary, q, ranking = hpd.weighted_summary(values, log_weights, points, truth_scores[target], levels, other)
        other = other or (summary, ranking)
        origin, covariance, scaled = weighted_moments(columns, q)
        summary["edge_mass"], summary["disagreement"] = refinement_checks(
            columns, q, (origin, covariance), last[target], box, extremes
        )
        # Rays start at the mean: far closer to a region's centre than the best point found.
        rays, ends = _ray_frame(scaled, q, values, covariance, origin, summary["threshold"].amin(dim=1), box)
        frames[target] = (origin, rays, ends, summary["threshold"])
        summaries[target] = summary
    return summaries, frames


def refine_block(score_fn, coarse, truths, cases, refinement):
    """Adaptive candidates and HPD summaries of a block of cases, for every target score_fn returns.

    `score_fn(points (B, n, p)) -> {target: scores (B, n)}` is called on the coarse
    design (points (K, p) and log measure (K,)) and the truths, once per refined pass
    and twice for probes, so every case evaluates exactly sizes["total"] points besides
    its truth (see the module's docstring for the steps). `cases` are the block's case
    indices (they seed each case's stream). Returns per case points (B, n, p) and log_measure (B, n) (probes
    last, at −inf; repeated lattice points at −inf too), scores (B, n + 1) (the truth's
    last), summaries of tensors (with edge_mass and disagreement), the last proposal
    per target, and the count of points each case evaluated.
    """
    levels, sizes, seed = hpd.check_levels(refinement.levels), refinement.sizes, refinement.seed
    device, box = truths.device, refinement.box.to(truths.device)
    coarse_points, coarse_log_measure = (values.to(device) for values in coarse)
    first, truth_scores = _coarse_scores(score_fn, coarse_points, truths, cases)
    multiplicity = coarse_log_measure + math.log(sizes["coarse"]) - box.log_measure()
    # Coarse points merged on a lattice leave their places to the last pass: every case evaluates the same count.
    coarse = coarse_points.shape[0]
    passes = sizes["passes"][:-1] + [sizes["passes"][-1] + sizes["coarse"] - coarse]
    measured = coarse + sum(passes)
    # One buffer per quantity holds every point of a case (probes last, then the truth's score).
    total = measured + len(first) * 2 * truths.shape[1] * (designs.PROBE_RADII + designs.PROBE_REFINE)
    columns = torch.empty(truths.shape[0], truths.shape[1], total, dtype=torch.float64, device=device)
    columns[:, :, :coarse] = coarse_points.T
    scores = {t: torch.empty(truths.shape[0], total + 1, dtype=torch.float64, device=device) for t in first}
    for target, values in scores.items():
        values[:, :coarse], values[:, -1] = first[target], truth_scores[target]
    measured_scores = {t: s[:, :measured] for t, s in scores.items()}
    refined = _refined_passes(
        score_fn,
        columns,
        measured_scores,
        multiplicity,
        box,
        dict(sizes, passes=passes, coarse_points=coarse),
        [case_seed(seed, case) for case in cases],
    )
    points = columns[:, :, :measured].transpose(1, 2)
    refined = refined._replace(log_weights=_merged(points, refined.log_weights, box))
    summaries, frames = _measured_summaries(points, refined, measured_scores, truth_scores, levels, box)
    probes, probe_scores = _probe(score_fn, frames, box)
    columns[:, :, measured:] = probes.transpose(1, 2)
    for target, summary in summaries.items():
        scores[target][:, measured:total] = probe_scores[target]
        _widen(summary, probes, probe_scores[target], measured_scores[target].amax(dim=1))
    log_measure = torch.full((truths.shape[0], total), -math.inf, dtype=torch.float64, device=device)
    log_measure[:, :measured] = refined.log_weights
    return {
        "points": columns.transpose(1, 2),
        "log_measure": log_measure,
        "scores": scores,
        "summaries": summaries,
        "proposals": refined.last,
        "evaluated": total,
    }
