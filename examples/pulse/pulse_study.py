"""A detector's response to a pulse, from a 200-point time series: a study on the kit with its own network.

A pulse of unknown amplitude A excites a detector whose response relaxes with an unknown
decay time τ. An observation is the response sampled at SAMPLES evenly spaced times t in
[0, 1], x_t = A e^(−t/τ) + ε_t with independent normal noise of sd NOISE. The likelihood is
exact: log p(x | A, τ) = Σ_t log N(x_t; A e^(−t/τ), NOISE²).

A long observation is what an embedding network is for (docs/extending.md, "Your own
network"): `Pulse.embedding` compresses the standardised series to FEATURES numbers with a
1-D convolution, and the classifier of the `model` section reads those features beside
(A, τ). Both train together.
"""

import torch

import nre_study

SAMPLES = 200
NOISE = 0.25
FEATURES = 8


def sample_times(dtype=torch.float64, device=None):
    """The SAMPLES times of an observation, evenly spaced in [0, 1]."""
    return torch.linspace(0.0, 1.0, SAMPLES, dtype=dtype, device=device)


def response(theta):
    """The noiseless response A e^(−t/τ) (..., SAMPLES) for θ = (A, τ) (..., 2)."""
    amplitude, decay_time = theta[..., :1], theta[..., 1:]
    return amplitude * torch.exp(-sample_times(theta.dtype, theta.device) / decay_time)


class Pulse(nre_study.Study):
    """Infer the amplitude and the decay time of a pulse's response from SAMPLES noisy samples."""

    parameters = {"amplitude": (0.5, 2.0), "decay_time": (0.05, 0.5)}

    def simulate(self, theta, generator):
        """One noisy series (n, SAMPLES) per parameter row."""
        noise = torch.randn(len(theta), SAMPLES, generator=generator, dtype=torch.float64)
        return response(theta) + NOISE * noise

    def log_likelihood(self, x, theta):
        """Exact log p(x | θ), broadcasting x (..., SAMPLES) against θ (..., 2)."""
        return torch.distributions.Normal(response(theta), NOISE).log_prob(x).sum(-1)

    def embedding(self):
        """A 1-D convolution from the standardised series (n, SAMPLES) to features (n, FEATURES)."""
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, SAMPLES)),  # one input channel
            torch.nn.Conv1d(1, 8, kernel_size=9, stride=4, padding=4),
            torch.nn.ReLU(),  # 200 -> 50 points
            torch.nn.Conv1d(8, 8, kernel_size=5, stride=2, padding=2),
            torch.nn.ReLU(),  # 50 -> 25 points
            torch.nn.AdaptiveAvgPool1d(5),
            torch.nn.Flatten(),  # 8 channels x 5 points
            torch.nn.Linear(40, FEATURES),
        )
