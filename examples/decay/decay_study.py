"""The decay rate of a radioactive source, from waiting times: a one-parameter study on the kit.

A source decays at an unknown rate λ (per second). An observation is the logs x of
WAITING_TIMES intervals between successive decays, independent and exponential with rate
λ. The parameter learned is θ = log λ, inside [log RATE_LOW, log RATE_HIGH]. The
likelihood is exact: log p(x | θ) = Σ (θ + x − e^(θ + x)).

Two priors: "log-uniform", uniform in θ (the bundled `uniform` family, named in the
settings), and "uniform-rate", uniform in λ, so its density in θ grows as e^θ (the prior
object below). The kit's analysis (nre_analysis.py) compares each learned posterior with
the exact one; docs/extending.md explains its metrics.
"""

import math

import torch

import nre_study

WAITING_TIMES = 8
RATE_LOW, RATE_HIGH = 0.2, 5.0


class UniformRate:
    """λ uniform on [RATE_LOW, RATE_HIGH]: in θ = log λ, the density e^θ / (RATE_HIGH − RATE_LOW)."""

    def sample(self, n, generator):
        """n values of θ, (n, 1)."""
        rate = RATE_LOW + (RATE_HIGH - RATE_LOW) * torch.rand(n, 1, generator=generator, dtype=torch.float64)
        return rate.log()

    def log_prob(self, theta):
        """log density of θ (..., 1); −inf outside the parameter's range."""
        theta = theta[..., 0]
        inside = (theta >= math.log(RATE_LOW)) & (theta <= math.log(RATE_HIGH))
        return torch.where(inside, theta - math.log(RATE_HIGH - RATE_LOW), -math.inf)

    def describe(self):
        """What run.json and the keys record about this prior."""
        return {"rate": "uniform", "low": RATE_LOW, "high": RATE_HIGH}


class Decay(nre_study.Study):
    """Infer θ = log λ from WAITING_TIMES log waiting times."""

    parameters = {"theta": (math.log(RATE_LOW), math.log(RATE_HIGH))}
    custom_priors = {"uniform-rate": UniformRate()}

    def simulate(self, theta, generator):
        """WAITING_TIMES log waiting times per row: log(E) − θ with E exponential(1)."""
        unit = torch.empty(len(theta), WAITING_TIMES, dtype=torch.float64).exponential_(generator=generator)
        return unit.log() - theta

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., WAITING_TIMES) against θ (..., 1)."""
        return (theta + x - torch.exp(theta + x)).sum(-1)
