"""Studies on the kit with exact reference posteriors, for bench_posterior_quality.py.

Each class is an ordinary kit study (parameters, simulate, log_likelihood) that nnpd trains,
plus what the bench needs around it: prior draws for the shared simulations and truths,
the prior as sbi sees it, the kit's prior settings, and `reference(x_o, n, generator)`,
n exact posterior draws for one observation.

  Ring      2 parameters: a thin ring cut by a band, so two thin curved arcs (bimodal).
  Slcp      5 parameters, four modes: 4 draws of a correlated 2-D Gaussian (SLCP-like).
  Linear    10 parameters: x = A θ + noise under a normal prior truncated at ±5 sd.
  Narrow    10 parameters: x = B θ + small noise under a correlated normal prior cut at ±5 prior sds,
            so a narrow (sds 2.5-5% of the box), correlated posterior (issue 36, point 0).
  Mixture   2 parameters: x = θ + noise whose sd is 1 or 0.1 by a fair coin, θ uniform on [-10, 10]^2:
            a posterior of a broad and a narrow Gaussian about x_o (sbibm's gaussian_mixture).
            Not in the benches' default lists: a check of rounds on a task they were not tuned on.
"""

import math

import torch

import nre_study

RING_SD, BAND_SD = 0.05, 0.5  # noise of |θ|² (thin ring) and of θ1 + θ2 (wide band)
SLCP_DRAWS, SLCP_BOX = 4, 3.0  # Gaussian draws per observation; the prior box [-3, 3]^5
LINEAR_DIM, LINEAR_SD, LINEAR_BOX = 10, 0.5, 5.0  # parameters, noise sd, box in prior sds
MIXTURE_SDS, MIXTURE_BOX = (1.0, 0.1), 10.0  # Mixture's two noise sds, equally likely; its box [-10, 10]^2
NARROW_SD, NARROW_RHO = 0.3, 0.8  # Narrow's noise sd and its prior's correlation ρ^|i − j| (unit sds)


def uniform_box(low, high, n, generator):
    """n uniform draws (n, p) from the box [low, high]."""
    unit = torch.rand(n, len(low), dtype=torch.float64, generator=generator)
    return low + (high - low) * unit


def gaussian_log_density(z, sd):
    """log N(z; 0, sd²) elementwise."""
    return -0.5 * (z / sd) ** 2 - math.log(sd) - 0.5 * math.log(2 * math.pi)


class Ring(nre_study.Study):
    """Infer a point θ from its squared radius (precise) and the sum of its coordinates (noisy)."""

    parameters = {"t1": (-2.0, 2.0), "t2": (-2.0, 2.0)}

    def simulate(self, theta, generator):
        """x = (|θ|² + noise, θ1 + θ2 + noise)."""
        noise = torch.randn(len(theta), 2, dtype=torch.float64, generator=generator)
        radius2 = (theta**2).sum(-1, keepdim=True)
        total = theta.sum(-1, keepdim=True)
        return torch.cat([radius2 + RING_SD * noise[:, :1], total + BAND_SD * noise[:, 1:]], -1)

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., 2) against θ (..., 2)."""
        radius2 = (theta**2).sum(-1)
        return gaussian_log_density(x[..., 0] - radius2, RING_SD) + gaussian_log_density(
            x[..., 1] - theta.sum(-1), BAND_SD
        )

    def reference(self, x_o, n, generator):
        """n exact draws by rejection from the uniform prior: accept with p(x_o | θ) / its Gaussian peak."""
        x_o = torch.as_tensor(x_o, dtype=torch.float64)
        log_peak = gaussian_log_density(torch.zeros(()), RING_SD) + gaussian_log_density(torch.zeros(()), BAND_SD)
        low, high = bounds(self)
        kept, count = [], 0
        while count < n:
            theta = uniform_box(low, high, 1 << 20, generator)
            accept = (
                torch.rand(len(theta), dtype=torch.float64, generator=generator).log()
                < self.log_likelihood(x_o, theta) - log_peak
            )
            kept.append(theta[accept])
            count += int(accept.sum())
        return torch.cat(kept)[:n]


def slcp_scales(theta):
    """The sds θ3², θ4² and the correlation tanh θ5 of rows θ (..., 5), each (...)."""
    return theta[..., 2] ** 2, theta[..., 3] ** 2, torch.tanh(theta[..., 4])


class Slcp(nre_study.Study):
    """SLCP-like: four draws of a 2-D Gaussian with mean (θ1, θ2), sds θ3², θ4², correlation tanh θ5."""

    parameters = {f"t{i + 1}": (-SLCP_BOX, SLCP_BOX) for i in range(5)}

    def simulate(self, theta, generator):
        """SLCP_DRAWS Gaussian draws per row, flattened to (n, 2 · SLCP_DRAWS); written out, so sd 0 is allowed."""
        s1, s2, rho = slcp_scales(theta[:, None])
        z1, z2 = torch.randn(2, len(theta), SLCP_DRAWS, dtype=torch.float64, generator=generator)
        first = theta[:, None, 0] + s1 * z1
        second = theta[:, None, 1] + s2 * (rho * z1 + (1 - rho**2).sqrt() * z2)
        return torch.stack([first, second], -1).reshape(len(theta), -1)

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., 8) against θ (..., 5)."""
        draws = x.reshape(*x.shape[:-1], SLCP_DRAWS, 2)
        s1, s2, rho = slcp_scales(theta[..., None, :])
        u = (draws[..., 0] - theta[..., None, 0]) / s1
        v = (draws[..., 1] - theta[..., None, 1]) / s2
        one_minus = 1 - rho**2
        terms = (
            -math.log(2 * math.pi)
            - s1.log()
            - s2.log()
            - 0.5 * one_minus.log()
            - (u * u - 2 * rho * u * v + v * v) / (2 * one_minus)
        )
        return terms.sum(-1)

    def reference(self, x_o, n, generator):
        """n exact draws (see slcp_reference)."""
        return slcp_reference(torch.as_tensor(x_o, dtype=torch.float64), n, generator)


def slcp_reference(x_o, n, generator):
    """Exact SLCP posterior draws by rejection from an inverse-Wishart proposal.

    With the mean integrated out, the likelihood of Σ is the scatter matrix S's Wishart
    term |Σ|^(-3/2) exp(-tr(Σ⁻¹S)/2) times P(N(x̄, Σ/4) in the box). Propose Σ from the
    inverse Wishart IW(S, ν = 5/2), map it to (θ3, θ4, θ5) with random signs (the four
    modes are equally likely), and the ratio of target to proposal in θ is
    (1 − ρ²)^(1/4) ≤ 1 times the box term: accept with that probability, where the box
    term is itself accepted exactly by drawing the mean from N(x̄, Σ/4) and keeping it when
    it falls in the box; that mean is then the exact conditional draw of (θ1, θ2).
    """
    draws = x_o.reshape(SLCP_DRAWS, 2)
    mean = draws.mean(0)
    centred = draws - mean
    scatter = centred.T @ centred
    kept, count = [], 0
    while count < n:
        batch = 1 << 16
        cov = inverse_wishart(scatter, 2.5, batch, generator)
        s1, s2 = cov[:, 0, 0].sqrt(), cov[:, 1, 1].sqrt()
        rho = (cov[:, 0, 1] / (s1 * s2)).clamp(-1 + 1e-15, 1 - 1e-15)
        signs = torch.randint(0, 2, (batch, 2), generator=generator, dtype=torch.float64) * 2 - 1
        theta = torch.stack([s1.sqrt() * signs[:, 0], s2.sqrt() * signs[:, 1], torch.atanh(rho)], -1)
        mu = (
            mean
            + (
                torch.linalg.cholesky(cov / SLCP_DRAWS)
                @ torch.randn(batch, 2, 1, dtype=torch.float64, generator=generator)
            )[..., 0]
        )
        accept = (
            (theta.abs() <= SLCP_BOX).all(-1)
            & (mu.abs() <= SLCP_BOX).all(-1)
            & (torch.rand(batch, dtype=torch.float64, generator=generator) < (1 - rho**2) ** 0.25)
        )
        kept.append(torch.cat([mu, theta], -1)[accept])
        count += int(accept.sum())
    return torch.cat(kept)[:n]


def inverse_wishart(scale, dof, n, generator):
    """n draws (n, 2, 2) of IW(scale, dof) as inverses of Wishart(scale⁻¹, dof) by Bartlett's decomposition."""
    lower = torch.linalg.cholesky(torch.linalg.inv(scale))
    chi2 = torch.distributions.Gamma(torch.tensor([dof / 2, (dof - 1) / 2], dtype=torch.float64), 0.5)
    with torch.random.fork_rng(devices=[]):  # Gamma draws from the global stream: seed it from ours
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=generator)))
        diagonal = chi2.sample((n,)).sqrt()
    bartlett = torch.zeros(n, 2, 2, dtype=torch.float64)
    bartlett[:, 0, 0], bartlett[:, 1, 1] = diagonal[:, 0], diagonal[:, 1]
    bartlett[:, 1, 0] = torch.randn(n, dtype=torch.float64, generator=generator)
    factor = lower @ bartlett
    return torch.linalg.inv(factor @ factor.transpose(-1, -2))


def linear_matrix():
    """The fixed mixing matrix A: identity plus a seeded perturbation, so the posterior is correlated."""
    generator = torch.Generator().manual_seed(2024)
    return torch.eye(LINEAR_DIM, dtype=torch.float64) + 0.5 * torch.randn(
        LINEAR_DIM, LINEAR_DIM, dtype=torch.float64, generator=generator
    ) / math.sqrt(LINEAR_DIM)


class Linear(nre_study.Study):
    """x = A θ + N(0, LINEAR_SD²) noise; prior N(0, 1) per parameter, truncated at ±LINEAR_BOX."""

    parameters = {
        f"t{i + 1}": {"low": -LINEAR_BOX, "high": LINEAR_BOX, "normal_mean": 0.0, "normal_std": 1.0}
        for i in range(LINEAR_DIM)
    }

    def simulate(self, theta, generator):
        """One noisy linear image of θ per row."""
        noise = torch.randn(len(theta), LINEAR_DIM, dtype=torch.float64, generator=generator)
        return theta @ linear_matrix().T + LINEAR_SD * noise

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., 10) against θ (..., 10)."""
        residual = x - theta @ linear_matrix().T
        return gaussian_log_density(residual, LINEAR_SD).sum(-1)

    def reference(self, x_o, n, generator):
        """n exact draws: the conjugate Gaussian posterior, rejecting the (negligible) draws outside the box."""
        matrix = linear_matrix()
        precision = torch.eye(LINEAR_DIM, dtype=torch.float64) + matrix.T @ matrix / LINEAR_SD**2
        cov = torch.linalg.inv(precision)
        mean = cov @ matrix.T @ torch.as_tensor(x_o, dtype=torch.float64) / LINEAR_SD**2
        chol = torch.linalg.cholesky(cov)
        kept, count = [], 0
        while count < n:
            theta = mean + torch.randn(n, LINEAR_DIM, dtype=torch.float64, generator=generator) @ chol.T
            theta = theta[(theta.abs() <= LINEAR_BOX).all(-1)]
            kept.append(theta)
            count += len(theta)
        return torch.cat(kept)[:n]


def narrow_model():
    """Narrow's prior covariance ρ^|i − j| and its fixed mixing matrix B (identity plus a seeded perturbation)."""
    index = torch.arange(LINEAR_DIM)
    covariance = NARROW_RHO ** (index[:, None] - index[None]).abs().double()
    noise = torch.randn(LINEAR_DIM, LINEAR_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(36))
    return covariance, torch.eye(LINEAR_DIM, dtype=torch.float64) + 0.8 * noise / math.sqrt(LINEAR_DIM)


def cut_gaussian_draws(mean, covariance, n, generator):
    """n draws of N(mean, covariance) cut to the box ±LINEAR_BOX, by rejection (exact)."""
    factor, kept, count = torch.linalg.cholesky(covariance), [], 0
    while count < n:
        theta = mean + torch.randn(n, LINEAR_DIM, dtype=torch.float64, generator=generator) @ factor.T
        theta = theta[(theta.abs() <= LINEAR_BOX).all(-1)]
        kept.append(theta)
        count += len(theta)
    return torch.cat(kept)[:n]


class CorrelatedPrior:
    """Narrow's prior, a study's own prior object: N(0, ρ^|i − j|) cut to ±LINEAR_BOX prior sds."""

    lattice_steps = [None] * LINEAR_DIM

    def sample(self, n, generator):
        """n draws (n, 10), by rejection from the uncut normal."""
        return cut_gaussian_draws(torch.zeros(LINEAR_DIM, dtype=torch.float64), narrow_model()[0], n, generator)

    def log_prob(self, theta):
        """The log density up to its constant (the cut's mass): −inf outside the box."""
        theta = torch.as_tensor(theta, dtype=torch.float64)
        value = -0.5 * ((theta @ torch.linalg.inv(narrow_model()[0])) * theta).sum(-1)
        return torch.where((theta.abs() <= LINEAR_BOX).all(-1), value, torch.full_like(value, -math.inf))

    def describe(self):
        """What the prior is, for its key."""
        return {"family": "correlated normal", "correlation": f"{NARROW_RHO}^|i-j|", "box_sds": LINEAR_BOX}


class Narrow(nre_study.Study):
    """x = B θ + N(0, NARROW_SD²) noise; θ under CorrelatedPrior: a narrow, correlated posterior."""

    parameters = {f"t{i + 1}": (-LINEAR_BOX, LINEAR_BOX) for i in range(LINEAR_DIM)}
    custom_priors = {"correlated": CorrelatedPrior()}

    def simulate(self, theta, generator):
        """One noisy linear image of θ per row."""
        noise = torch.randn(len(theta), LINEAR_DIM, dtype=torch.float64, generator=generator)
        return theta @ narrow_model()[1].T + NARROW_SD * noise

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., 10) against θ (..., 10)."""
        return gaussian_log_density(x - theta @ narrow_model()[1].T, NARROW_SD).sum(-1)

    def reference(self, x_o, n, generator):
        """n exact draws: the uncut prior's conjugate Gaussian posterior, cut to the box by rejection (exact:
        the cut prior's posterior is the uncut one's, cut)."""
        covariance, matrix = narrow_model()
        posterior_cov = torch.linalg.inv(torch.linalg.inv(covariance) + matrix.T @ matrix / NARROW_SD**2)
        mean = posterior_cov @ matrix.T @ torch.as_tensor(x_o, dtype=torch.float64) / NARROW_SD**2
        return cut_gaussian_draws(mean, posterior_cov, n, generator)


class Mixture(nre_study.Study):
    """Infer a location from one draw about it whose noise is broad or narrow, by a fair coin."""

    parameters = {"t1": (-MIXTURE_BOX, MIXTURE_BOX), "t2": (-MIXTURE_BOX, MIXTURE_BOX)}

    def simulate(self, theta, generator):
        """x = θ + sd · noise, sd one of MIXTURE_SDS, each with probability 1/2."""
        coin = torch.rand(len(theta), 1, dtype=torch.float64, generator=generator) < 0.5
        sd = torch.where(coin, MIXTURE_SDS[0], MIXTURE_SDS[1])
        return theta + sd * torch.randn(theta.shape, dtype=torch.float64, generator=generator)

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ): the two components' densities, each weighted 1/2."""
        z = x - theta
        parts = [gaussian_log_density(z, sd).sum(-1) + math.log(0.5) for sd in MIXTURE_SDS]
        return torch.logaddexp(*parts)

    def reference(self, x_o, n, generator):
        """n exact draws: the posterior is the same mixture about x_o, cut to the box (by rejection)."""
        x_o = torch.as_tensor(x_o, dtype=torch.float64)
        low, high = bounds(self)
        kept, count = [], 0
        while count < n:
            coin = torch.rand(2 * n, 1, dtype=torch.float64, generator=generator) < 0.5
            sd = torch.where(coin, MIXTURE_SDS[0], MIXTURE_SDS[1])
            theta = x_o + sd * torch.randn(2 * n, 2, dtype=torch.float64, generator=generator)
            theta = theta[((theta >= low) & (theta <= high)).all(-1)]
            kept.append(theta)
            count += len(theta)
        return torch.cat(kept)[:n]


def bounds(study):
    """The box (low, high) of a study's parameters, float64 (p,)."""
    values = [v if isinstance(v, dict) else dict(zip(("low", "high"), v)) for v in study.parameters.values()]
    return (
        torch.tensor([v["low"] for v in values], dtype=torch.float64),
        torch.tensor([v["high"] for v in values], dtype=torch.float64),
    )


def prior_draws(study, n, generator):
    """n draws of the study's prior: uniform on the box, the truncated normal of Linear or Narrow's own."""
    if isinstance(study, Narrow):
        return CorrelatedPrior().sample(n, generator)
    low, high = bounds(study)
    if not isinstance(study, Linear):
        return uniform_box(low, high, n, generator)
    kept, count = [], 0
    while count < n:  # a draw outside ±5 sd is rare (about 6e-6 of the 10-D rows)
        theta = torch.randn(n, LINEAR_DIM, dtype=torch.float64, generator=generator)
        theta = theta[(theta.abs() <= LINEAR_BOX).all(-1)]
        kept.append(theta)
        count += len(theta)
    return torch.cat(kept)[:n]


def kit_priors(study):
    """The kit's `priors` settings and the cohort's prior: the bundled uniform family, the normal family for
    Linear, Narrow's own object (custom_priors, so no settings)."""
    if isinstance(study, Narrow):
        return {}, "correlated"
    return {"prior": {"family": "normal" if isinstance(study, Linear) else "uniform"}}, "prior"


def sbi_prior(study):
    """The prior as the sbi runner builds it: a box, or an untruncated normal for Linear and Narrow (its cut is
    under 1e-4 of the mass)."""
    if isinstance(study, Linear):
        return {"kind": "normal", "dimension": LINEAR_DIM}
    if isinstance(study, Narrow):
        return {"kind": "normal", "dimension": LINEAR_DIM, "covariance": narrow_model()[0].tolist()}
    low, high = bounds(study)
    return {"kind": "box", "low": low.tolist(), "high": high.tolist()}


PROBLEMS = {"ring": Ring, "slcp": Slcp, "linear": Linear, "narrow": Narrow, "mixture": Mixture}
DEFAULT_PROBLEMS = ("ring", "slcp", "linear", "narrow")  # the benches' tables; mixture is run when named
