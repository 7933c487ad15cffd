"""A simulator that fails in part of the box: a one-parameter study on the study kit.

x = θ + noise, two numbers, except that the simulator fails (returns NaN) above θ = 2.5, a
fifth of the box [0, 3]. With `data.invalid = "drop"` in its training settings, training
drops those simulations and the analysis drops the truths whose observations are invalid;
both are counted in `run.json`, `metrics.json` (`invalid_truths`), the report's notes and
its CSV. The prior `lognormal` is the study's own, with some mass above the box.
docs/extending.md ("Failing simulations, a prior beyond the box, progress") walks through it.
"""

import torch

import nre_study


class LogNormal:
    """A prior of the study's own, log-normal with median 1: some mass lies above the box's 3."""

    def sample(self, n, generator):
        """n draws (n, 1) from `generator`'s stream."""
        return torch.exp(torch.randn(n, 1, generator=generator, dtype=torch.float64))

    def log_prob(self, theta):
        """The log density at rows θ (n, 1)."""
        return torch.distributions.LogNormal(0.0, 1.0).log_prob(theta.clamp_min(1e-300)).sum(-1)


class Fragile(nre_study.Study):
    """x = θ + noise, except that the simulator fails (NaN) above θ = 2.5."""

    parameters = {"rate": (0.0, 3.0)}
    custom_priors = {"lognormal": LogNormal()}

    def simulate(self, theta, generator):
        """Two noisy copies of θ per row; NaN where θ > 2.5, where this simulator fails."""
        x = theta + 0.1 * torch.randn(len(theta), 2, generator=generator, dtype=torch.float64)
        x[theta[:, 0] > 2.5] = float("nan")
        return x
