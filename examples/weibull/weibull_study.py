"""Component lifetimes under a Weibull failure law: a two-parameter study on the study kit.

A component survives past time s with probability exp(-(s/λ)^k): shape k, scale λ. An
observation is the log lifetimes y of PARTS components. y is Gumbel (minimum) distributed,
with location log λ and scale 1/k, so the likelihood is exact and cheap:

    log p(y | k, λ) = Σ_parts [log k + z − e^z],   z = k (y − log λ).

Its posterior is skewed in k and correlated between k and λ, nothing like a Gaussian.
docs/extending.md walks through this file and its two settings files.
"""

import torch

import nre_study

PARTS = 6  # lifetimes in one observation


class Weibull(nre_study.Study):
    """Infer the shape and scale of a Weibull lifetime from log lifetimes."""

    parameters = {"shape": (0.5, 3.0), "scale": (0.5, 2.0)}  # (low, high): the box, no lattice

    def simulate(self, theta, generator):
        """PARTS log lifetimes per row: log t = log λ + log(E) / k with E exponential(1)."""
        shape, scale = theta[:, :1], theta[:, 1:]
        unit = torch.empty(len(theta), PARTS, dtype=torch.float64).exponential_(generator=generator)
        return scale.log() + unit.log() / shape

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., PARTS) against θ (..., 2)."""
        shape, scale = theta[..., :1], theta[..., 1:]
        z = shape * (x - scale.log())
        return (shape.log() + z - z.exp()).sum(-1)
