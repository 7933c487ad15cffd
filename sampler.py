"""Draws of a log density on a box: Gaussian mixture proposals fitted by weighted EM, adapted to the density by
population Monte Carlo when the candidates' fit is too rough, and sampled by rejection.

    proposal, info = propose(log_prob, Candidates(points, masses), box, generator)
    draws, info = rejection_sample(log_prob, points, masses, box, n, generator)

Two paths find the density's mass (`info["path"]`):
- "candidates": a mixture fitted to the weighted candidates of a design, refitted on its
  own weighted draws (ADAPT_ROUNDS). Where the candidates resolve the posterior (low
  dimensions, or a posterior wide against its box) this is the whole adaptation.
- "population Monte Carlo": when the candidates hold too few effective points to place
  a proposal (fewer than MIN_FIT_ESS), or the draws the proposal was fitted to are too few
  effective to place its covariance (ESCALATE times a full-covariance Gaussian's
  parameters). A tempered search first finds the density's modes (tempered_particles:
  sequential Monte Carlo from the uniform box to the density through exp(β log p), with
  Metropolis moves), a mixture of 1 to 8 full-covariance components is fitted to its
  particles, and population Monte Carlo weighs and shapes it over passes of PMC_DRAWS
  draws: each pass refits the mixture by EM from itself (its modes kept) to its own draws
  weighted by (p/q)^β, β ≤ 1 the largest that keeps TEMPERED_SHARE of them effective, so a
  proposal far from the posterior moves to it through q^(1-β) p^β instead of collapsing
  onto a few draws. A narrow, correlated posterior in ten parameters, which an axis-aligned
  design resolves into a handful of effective candidates at any candidate_count, is found
  so, and so are four narrow modes the design saw only some of.

Either proposal is widened, made defensive and sampled by rejection (see rejection_sample):
the candidates and the passes only place the proposal, they do not limit the accuracy of
the draws. It works on callables and tensors and knows no study.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

import study
from store import NnpdError

__all__ = [
    "ADAPT_ROUNDS",
    "BUDGET",
    "BUDGET_FLOOR",
    "CHUNK",
    "Adapted",
    "Candidates",
    "MIN_FIT_ESS",
    "Mixture",
    "PILOT",
    "PMC_DRAWS",
    "PosteriorError",
    "defensive",
    "effective_size",
    "fit_mixture",
    "population_monte_carlo",
    "propose",
    "proposal_draws",
    "refit",
    "rejection_sample",
    "select_mixture",
    "tempered_particles",
    "weighted_em",
]

LogProb = Callable[[torch.Tensor], torch.Tensor]  # θ (n, p) -> log density (n,), −inf outside the support

# Effective candidates below which the candidates place no proposal: the tempered search and population
# Monte Carlo find the density instead. (At 10 parameters the default design's 50-60 effective candidates
# placed one well: C2ST 0.50-0.51 against exact draws.)
MIN_FIT_ESS = 10
COMPONENT_CHOICES = (1, 2, 4, 8)  # mixture sizes tried on the weighted candidates
EM_ITERATIONS = 40
EM_TOLERANCE = 1e-3  # nats per effective point: an EM step gaining less ends the fit
WIDEN = 1.15  # the proposal's sd over a fitted component's: its tails must cover the posterior's
WIDE = 2.0  # a wider copy, for the tails a fit from few effective points underestimates
SHARES = (0.88, 0.1, 0.02)  # of the widened mixture, its wide copy and the uniform box (no region left out)
ADAPT_ROUNDS = 2  # refits of the proposal on its own weighted draws
PILOT = 4096  # draws per refit
CHUNK = 8192  # proposal draws scored at once: bounds the sampler's memory
BUDGET = 25  # proposal draws allowed per draw asked: an acceptance below 1/25 falls back
BUDGET_FLOOR = 1024  # fewer draws asked are budgeted as this many

SMC_PARTICLES = 2048  # particles of the tempered search that starts population Monte Carlo
SMC_MOVES = 5  # Metropolis moves of every particle at each temperature
SMC_KEEP = 0.5  # each temperature step keeps this share of the particles effective
MIN_COMPONENT = 0.01  # a component of less than this share of the mass is dropped by a PMC refit
PMC_DRAWS = 4096  # proposal draws per population Monte Carlo pass
PMC_PASSES = 24  # passes at most
TEMPERED_SHARE = 0.1  # a pass's fit keeps at least this share of its draws effective, tempering their weights
SETTLED_SHARE = 0.5  # an untempered pass with this share of its draws effective ends the adaptation
GAIN = 1.05  # ... as does one whose effective share grew less than this factor over the last
# The candidates' proposal is adapted further when the draws it was fitted to hold fewer effective points
# than this many times a full-covariance Gaussian's parameters (p + p(p + 1)/2: 260 at p = 10, 8 at p = 1).
ESCALATE = 4


class PosteriorError(NnpdError, ValueError):
    """A posterior that cannot be computed or sampled as asked; the message says why and what to change."""


class Mixture(NamedTuple):
    """Gaussian components: log shares (K,), means (K, p) and lower Cholesky factors of covariances (K, p, p)."""

    log_shares: torch.Tensor
    means: torch.Tensor
    factors: torch.Tensor


def component_log_terms(mixture, x):
    """log π_k N(x; μ_k, L_k L_kᵀ) (K, n) of every component at rows x (n, p)."""
    offsets = (x[None] - mixture.means[:, None]).transpose(1, 2)  # (K, p, n)
    z = torch.linalg.solve_triangular(mixture.factors, offsets, upper=False)
    log_det = mixture.factors.diagonal(dim1=1, dim2=2).log().sum(dim=1)
    constant = mixture.log_shares - log_det - 0.5 * x.shape[1] * math.log(2 * math.pi)
    return constant[:, None] - 0.5 * (z * z).sum(dim=1)


def _seed_means(x, q, components, generator):
    """k-means++ seeds under weights q: each next seed drawn ∝ q · (squared distance to the nearest seed)."""
    chosen = [int(torch.multinomial(q, 1, generator=generator))]
    nearest = ((x - x[chosen[0]]) ** 2).sum(dim=1)
    for _ in range(components - 1):
        odds = q * nearest
        if not bool(odds.sum() > 0):
            break
        chosen.append(int(torch.multinomial(odds, 1, generator=generator)))
        nearest = torch.minimum(nearest, ((x - x[chosen[-1]]) ** 2).sum(dim=1))
    return x[chosen]


def weighted_em(
    mixture: Mixture,
    x: torch.Tensor,
    q: torch.Tensor,
    ridge: torch.Tensor,
    kept: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[Mixture, float]:
    """Weighted EM from `mixture` on points x (n, p) with normalised weights q, each covariance plus `ridge`, until
    a step gains less than EM_TOLERANCE; `kept(shares)` says which components stay. Returns the mixture and the
    weighted mean log density it reached."""
    fit = -math.inf
    for _ in range(EM_ITERATIONS):
        terms = component_log_terms(mixture, x)
        density = torch.logsumexp(terms, dim=0)
        previous, fit = fit, float(q @ density)
        if fit - previous < EM_TOLERANCE:
            break
        r = torch.exp(terms - density) * q  # (K, n)
        share = r.sum(dim=1)
        alive = kept(share)
        r, share = r[alive], share[alive]
        means = (r @ x) / share[:, None]
        offsets = (x[None] - means[:, None]) * r[:, :, None].sqrt()
        covariance = offsets.transpose(1, 2) @ offsets / share[:, None, None] + ridge
        mixture = Mixture(share.log(), means, torch.linalg.cholesky(covariance))
    return mixture, fit


def fit_mixture(x, q, components, generator):
    """A Gaussian mixture fitted by weighted EM to points x (n, p) with normalised weights q (n,), and the
    weighted mean log density it reaches."""
    p = x.shape[1]
    mean = q @ x
    spread = ((x - mean) ** 2 * q[:, None]).sum(dim=0)
    # A ridge of a millionth of each axis' variance keeps a component on few points invertible.
    ridge = torch.diag(spread.clamp(min=1e-300) * 1e-6)
    means = _seed_means(x, q, components, generator)
    start = torch.linalg.cholesky(torch.diag(spread) / means.shape[0] ** (2 / p) + ridge)
    mixture = Mixture(
        torch.full((means.shape[0],), -math.log(means.shape[0]), dtype=x.dtype),
        means,
        start.expand(means.shape[0], p, p).clone(),
    )
    return weighted_em(mixture, x, q, ridge, lambda share: share > 1e-9 * share.max())


def select_mixture(x, q, generator):
    """The mixture of COMPONENT_CHOICES that fits the weighted points best by BIC, counting Kish's effective
    size as the number of points (more components only where they pay for their parameters)."""
    ess = float(1.0 / (q * q).sum())
    p = x.shape[1]
    best = None
    for components in COMPONENT_CHOICES:
        parameters = components * (p + p * (p + 1) / 2 + 1) - 1
        if components > 1 and parameters > ess:
            break  # fewer effective points than parameters: nothing to place these components by
        mixture, fit = fit_mixture(x, q, components, generator)
        bic = -2 * ess * fit + parameters * math.log(ess)
        if best is not None and bic >= best[0]:
            break  # more components stopped paying for themselves
        best = (bic, mixture)
    assert best is not None  # the first choice, one component, is always fitted
    return best[1]


def defensive(mixture, box):
    """The proposal: the mixture widened by WIDEN, a WIDE copy and the uniform box, by SHARES; the uniform's
    log density on the box last."""
    main, wide, uniform = SHARES
    widened = Mixture(
        torch.cat([mixture.log_shares + math.log(main), mixture.log_shares + math.log(wide)]),
        torch.cat([mixture.means, mixture.means]),
        torch.cat([mixture.factors * WIDEN, mixture.factors * WIDE]),
    )
    return widened, math.log(uniform) - float(torch.log(box.high - box.low).sum())


def proposal_draws(proposal, box, count, generator):
    """count draws of the proposal, less those outside the box, and the proposal's log density at them.

    Dropping the outside draws truncates the proposal to the box: its density there is the
    untruncated one over a constant, which rejection sampling does not need.
    """
    mixture, log_uniform = proposal
    log_volume = float(torch.log(box.high - box.low).sum())
    shares = torch.cat([mixture.log_shares, torch.tensor([log_uniform + log_volume], dtype=torch.float64)]).exp()
    choice = torch.multinomial(shares, count, replacement=True, generator=generator)
    p = box.low.numel()
    gaussian = torch.randn(count, p, dtype=torch.float64, generator=generator)
    uniform = torch.rand(count, p, dtype=torch.float64, generator=generator)
    component = choice.clamp(max=mixture.means.shape[0] - 1)
    drawn = mixture.means[component] + (mixture.factors[component] @ gaussian[:, :, None])[:, :, 0]
    drawn = torch.where((choice == mixture.means.shape[0])[:, None], box.low + (box.high - box.low) * uniform, drawn)
    drawn = drawn[((drawn >= box.low) & (drawn <= box.high)).all(dim=1)]
    log_q = torch.logaddexp(
        torch.logsumexp(component_log_terms(mixture, drawn), dim=0), torch.tensor(log_uniform, dtype=torch.float64)
    )
    return drawn, log_q


def weighted_draws(log_prob, proposal, box, count, generator):
    """Draws of the proposal inside the box and their log importance weights log p − log q."""
    drawn, log_q = proposal_draws(proposal, box, count, generator)
    return drawn, torch.nan_to_num(log_prob(drawn), nan=-math.inf) - log_q


def effective_size(log_w: torch.Tensor) -> float:
    """Kish's effective size (Σw)²/Σw² of log importance weights (n,); 0 when every weight is zero."""
    finite = log_w[torch.isfinite(log_w)]
    if not finite.numel():
        return 0.0
    return float(torch.exp(2 * torch.logsumexp(finite, 0) - torch.logsumexp(2 * finite, 0)))


def gaussian_parameters(p: int) -> int:
    """The free parameters of one full-covariance Gaussian in p dimensions: its mean and covariance."""
    return p + p * (p + 1) // 2


class Candidates(NamedTuple):
    """A design's candidates as the sampler sees them: points (n, p) and their normalised masses (n,)."""

    points: torch.Tensor
    masses: torch.Tensor


def fit_proposal(log_prob, points, masses, box, generator):
    """A mixture fitted to the weighted candidates, then refitted on its own weighted draws while their effective
    size grows (ADAPT_ROUNDS at most); returns it, the effective size of the points it was fitted to and the
    log_prob evaluations this cost.

    The candidates of a many-parameter design hold few effective points (a hundred, say,
    at ten parameters), which place a covariance roughly; PILOT draws of a proposal
    already near the posterior hold far more.
    """
    usable = masses > 0
    q = masses[usable] / masses[usable].sum()
    mixture, ess, evaluations = select_mixture(points[usable], q, generator), float(1 / (q * q).sum()), 0
    for _ in range(ADAPT_ROUNDS):
        drawn, log_w = weighted_draws(log_prob, defensive(mixture, box), box, PILOT, generator)
        evaluations += drawn.shape[0]
        if not bool(torch.isfinite(log_w).any()):
            break
        w = torch.softmax(log_w, dim=0)
        pilot_ess = float(1 / (w * w).sum())
        if not pilot_ess > ess:
            break
        mixture, ess = select_mixture(drawn, w, generator), pilot_ess
    return mixture, ess, evaluations


# ---------------------------------------------------------------- population Monte Carlo


class Adapted(NamedTuple):
    """A mixture adapted by population Monte Carlo, with its passes, the last pass's untempered effective share
    of its draws, the last pass's tempering exponent β and the log_prob evaluations it cost."""

    mixture: Mixture
    passes: int
    effective_share: float
    beta: float
    evaluations: int


def tempered_weights(log_w: torch.Tensor, target: float) -> tuple[float, torch.Tensor]:
    """(β, q): the largest β ≤ 1 whose normalised weights q ∝ w^β keep `target` effective draws, by bisection
    (β = 1 when the weights themselves do), and those weights."""
    finite = torch.where(torch.isfinite(log_w), log_w, torch.full_like(log_w, -math.inf))
    if effective_size(finite) >= target:
        return 1.0, torch.softmax(finite, 0)
    low, high = 0.0, 1.0
    for _ in range(40):  # β to about 1e-12: ample, each step one softmax
        middle = (low + high) / 2
        low, high = (middle, high) if effective_size(middle * finite) >= target else (low, middle)
    return low, torch.softmax(low * finite, 0)


def population_monte_carlo(log_prob: LogProb, start: Mixture, box: Any, generator: torch.Generator) -> Adapted:
    """The mixture `start` adapted to exp(log_prob) over passes of PMC_DRAWS draws of its defensive proposal.

    Each pass refits the mixture (select_mixture) to its draws weighted by (p/q)^β, β the
    largest keeping TEMPERED_SHARE of them effective: a proposal far from the density takes
    a step towards it, not a collapse onto its few heaviest draws. The passes end when an
    untempered pass (β = 1) has SETTLED_SHARE of its draws effective, or gained less than
    GAIN over the previous one, or after PMC_PASSES.
    """
    mixture, evaluations, share, beta, previous = start, 0, 0.0, 0.0, 0.0
    for done in range(1, PMC_PASSES + 1):
        drawn, log_w = weighted_draws(log_prob, defensive(mixture, box), box, PMC_DRAWS, generator)
        evaluations += drawn.shape[0]
        if not bool(torch.isfinite(log_w).any()):
            return Adapted(mixture, done, 0.0, 0.0, evaluations)  # the defensive box share keeps looking
        beta, q = tempered_weights(log_w, TEMPERED_SHARE * drawn.shape[0])
        share = effective_size(log_w) / drawn.shape[0]
        mixture = refit(mixture, drawn, q)
        if beta == 1.0 and (share >= SETTLED_SHARE or share < GAIN * previous):
            break
        previous = share if beta == 1.0 else 0.0
    return Adapted(mixture, done, share, beta, evaluations)


def _next_temperature(log_p: torch.Tensor, beta: float) -> float:
    """The largest temperature β' ≤ 1 whose incremental weights exp((β' − β) log p) keep SMC_KEEP of the
    particles effective, by bisection."""
    target = SMC_KEEP * log_p.numel()
    if effective_size((1.0 - beta) * log_p) >= target:
        return 1.0
    low, high = beta, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if effective_size((middle - beta) * log_p) >= target else (low, middle)
    return max(low, beta + 1e-9)  # a step however small: the search always advances


def _metropolis_moves(log_prob, particles, log_p, beta, box, generator):
    """SMC_MOVES random-walk Metropolis moves of every particle, invariant for exp(β log p) on the box, with
    the particles' own covariance scaled by 2.38²/p; returns particles, log p and the evaluations made."""
    n, p = particles.shape
    covariance = torch.cov(particles.T).reshape(p, p) + torch.diag(((box.high - box.low) * 1e-6) ** 2)
    factor, evaluations = torch.linalg.cholesky(covariance) * (2.38 / math.sqrt(p)), 0
    for _ in range(SMC_MOVES):
        moved = particles + torch.randn(n, p, dtype=torch.float64, generator=generator) @ factor.T
        inside = ((moved >= box.low) & (moved <= box.high)).all(dim=1)
        log_moved = torch.full_like(log_p, -math.inf)
        log_moved[inside] = torch.nan_to_num(log_prob(moved[inside]), nan=-math.inf)
        evaluations += int(inside.sum())
        log_u = torch.rand(n, dtype=torch.float64, generator=generator).log()
        accept = torch.isfinite(log_moved) & (log_u < beta * (log_moved - log_p))
        particles, log_p = torch.where(accept[:, None], moved, particles), torch.where(accept, log_moved, log_p)
    return particles, log_p, evaluations


def tempered_particles(log_prob: LogProb, box: Any, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """SMC_PARTICLES draws that have found the density's modes, and the log_prob evaluations they cost.

    Sequential Monte Carlo from the uniform box to exp(log_prob) through exp(β log_prob):
    each step raises β as far as keeps SMC_KEEP of the particles effective, resamples
    them and moves them by Metropolis. At small β the tempered density spans every mode,
    and each mode keeps its particles as β grows, so modes the candidates never saw are
    found. Their shares are only roughly right: population Monte Carlo weighs them after.
    """
    p = box.low.numel()
    particles = box.low + (box.high - box.low) * torch.rand(SMC_PARTICLES, p, dtype=torch.float64, generator=generator)
    log_p = torch.nan_to_num(log_prob(particles), nan=-math.inf)
    beta, evaluations = 0.0, SMC_PARTICLES
    while beta < 1.0 and bool(torch.isfinite(log_p).any()):
        step = _next_temperature(log_p, beta)
        chosen = torch.multinomial(
            torch.softmax((step - beta) * log_p, dim=0), SMC_PARTICLES, replacement=True, generator=generator
        )
        particles, log_p, beta = particles[chosen], log_p[chosen], step
        particles, log_p, moved = _metropolis_moves(log_prob, particles, log_p, beta, box, generator)
        evaluations += moved
    return particles, evaluations


def start_mixture(log_prob: LogProb, box: Any, generator: torch.Generator) -> tuple[Mixture, int]:
    """The first PMC mixture, fitted (select_mixture) to the particles of tempered_particles, and the
    evaluations it cost."""
    particles, evaluations = tempered_particles(log_prob, box, generator)
    uniform = torch.full((particles.shape[0],), 1.0 / particles.shape[0], dtype=torch.float64)
    return select_mixture(particles, uniform, generator), evaluations


def refit(mixture: Mixture, x: torch.Tensor, q: torch.Tensor) -> Mixture:
    """The mixture refitted by weighted EM to points x (n, p) with normalised weights q, started from itself:
    its components (the modes found) are kept, but those holding less than MIN_COMPONENT of the mass."""
    spread = ((x - q @ x) ** 2 * q[:, None]).sum(dim=0)
    ridge = torch.diag(spread.clamp(min=1e-300) * 1e-6)  # as in fit_mixture
    return weighted_em(mixture, x, q, ridge, lambda share: share > MIN_COMPONENT * share.sum())[0]


def propose(log_prob: LogProb, candidates: Candidates, box: Any, generator: torch.Generator) -> tuple[Any, dict]:
    """The defensive proposal of rejection_sample and how it was found (see the module's docstring): `path`,
    `components`, `evaluations`, `passes` and `fitted_effective` (the effective size of the draws or candidates
    the candidates' mixture was fitted to)."""
    masses, p = candidates.masses, box.low.numel()
    fitted, evaluations = float(1 / (masses * masses).sum()) if bool(masses.sum() > 0) else 0.0, 0
    if fitted >= MIN_FIT_ESS:
        mixture, fitted, evaluations = fit_proposal(log_prob, candidates.points, masses, box, generator)
        if fitted >= ESCALATE * gaussian_parameters(p):
            return defensive(mixture, box), {
                "path": "candidates",
                "components": int(mixture.means.shape[0]),
                "evaluations": evaluations,
                "passes": 0,
                "fitted_effective": fitted,
            }
    start, searched = start_mixture(log_prob, box, generator)
    adapted = population_monte_carlo(log_prob, start, box, generator)
    return defensive(adapted.mixture, box), {
        "path": "population Monte Carlo",
        "components": int(adapted.mixture.means.shape[0]),
        "evaluations": evaluations + searched + adapted.evaluations,
        "passes": adapted.passes,
        "fitted_effective": fitted,
    }


# ---------------------------------------------------------------- rejection


def _resample_into(slots, log_total, drawn, log_w, generator):
    """Streaming importance resampling: every slot takes a draw of this chunk, ∝ its weight, with the chunk's
    share of all weight seen, so each slot holds draw i with probability w_i / Σw; returns log Σw."""
    chunk = torch.logsumexp(log_w, dim=0)
    if not bool(torch.isfinite(chunk)):
        return log_total
    log_total = torch.logaddexp(log_total, chunk)
    replace = torch.rand(slots.shape[0], dtype=torch.float64, generator=generator) < torch.exp(chunk - log_total)
    count = int(replace.sum())
    if count:
        slots[replace] = drawn[
            torch.multinomial(torch.softmax(log_w, dim=0), count, replacement=True, generator=generator)
        ]
    return log_total


class Drawn(NamedTuple):
    """What the rejection loop made: the accepted draws, the streaming resample's slots, log Σw and log Σw² of
    every proposal draw's weight, the proposal draws made and the log_prob evaluations they cost."""

    kept: torch.Tensor
    slots: torch.Tensor
    log_total: torch.Tensor
    log_squares: torch.Tensor
    proposed: int
    evaluations: int


def _rejection_loop(log_prob, proposal, box, n, generator, budget):
    """Proposal draws in chunks until n are accepted or the budget is spent (see rejection_sample)."""
    p = box.low.numel()
    kept, kept_log_w, kept_log_u = (torch.empty(shape, dtype=torch.float64) for shape in ((0, p), (0,), (0,)))
    slots, log_total = torch.empty(n, p, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
    log_squares = torch.tensor(-math.inf, dtype=torch.float64)
    log_bound, proposed, evaluations, chunk = -math.inf, 0, 0, min(CHUNK, max(1024, 2 * n))
    while kept.shape[0] < n and proposed < budget * max(n, BUDGET_FLOOR):
        drawn, log_w = weighted_draws(log_prob, proposal, box, chunk, generator)
        proposed, evaluations = proposed + chunk, evaluations + drawn.shape[0]
        log_u = torch.rand(drawn.shape[0], dtype=torch.float64, generator=generator).log()
        log_total = _resample_into(slots, log_total, drawn, log_w, generator)
        log_squares = torch.logaddexp(log_squares, torch.logsumexp(2 * log_w, dim=0)) if drawn.shape[0] else log_squares
        log_bound = max(log_bound, float(log_w.max())) if drawn.shape[0] else log_bound
        if log_bound == -math.inf:
            continue  # nothing of positive density seen yet
        kept, kept_log_w, kept_log_u = (
            torch.cat(pair) for pair in ((kept, drawn), (kept_log_w, log_w), (kept_log_u, log_u))
        )
        inside = kept_log_u < kept_log_w - log_bound  # u < w / M, for the bound as it is now
        kept, kept_log_w, kept_log_u = kept[inside], kept_log_w[inside], kept_log_u[inside]
        study.report_progress("samples", min(kept.shape[0], n), n)
    return Drawn(kept, slots, log_total, log_squares, proposed, evaluations)


def rejection_sample(log_prob, points, masses, box, n, generator, budget=BUDGET):
    """n independent draws of exp(log_prob) on a continuous box, and how they were made.

    The proposal (propose: the candidates' mixture, or one found by the tempered search and
    adapted by population Monte Carlo) proposes fresh points; a point of weight w = p/q is
    accepted when u < w / M, M the largest weight seen so far. When M grows, the points accepted
    under the old bound are thinned by the same uniforms (u < w / M again), which keeps the kept set an exact rejection
    sample for the final M: exact wherever p/q stays below the largest weight seen. When
    the budget of proposal draws (`budget` per draw asked) runs out first, the draws are an
    importance resample of every proposal draw made ("resampled-proposal"). The returned
    dict's `effective` is the effective size of all those proposal draws (Kish's).
    """
    study.report_progress("samples", 0, n)  # fitting the proposal is part of the wait
    proposal, info = propose(log_prob, Candidates(points, masses), box, generator)
    drawn = _rejection_loop(log_prob, proposal, box, n, generator, budget)
    effective = torch.exp(2 * drawn.log_total - drawn.log_squares) if bool(torch.isfinite(drawn.log_squares)) else 0
    info = dict(
        info,
        method="rejection",
        evaluations=info["evaluations"] + drawn.evaluations,
        acceptance=drawn.kept.shape[0] / max(drawn.proposed, 1),
        effective=float(effective),
    )
    if drawn.kept.shape[0] >= n:
        return drawn.kept[:n], info
    if not bool(torch.isfinite(drawn.log_total)):
        raise PosteriorError(
            f"no proposal draw of {info['evaluations']} had positive density; raise "
            "inference.candidates.candidate_count"
        )
    return drawn.slots, dict(info, method="resampled-proposal")
