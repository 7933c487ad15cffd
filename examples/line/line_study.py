"""The smallest study (README.md): a straight line seen at five times, with noise."""

import torch

import nre_study


class Line(nre_study.Study):
    parameters = {"slope": (-1.0, 1.0), "offset": (-1.0, 1.0)}  # (low, high): the box

    def simulate(self, theta, generator):  # θ (n, 2) -> x (n, 5), every random number from generator
        t = torch.linspace(0.0, 1.0, 5, dtype=torch.float64)
        noise = 0.1 * torch.randn(len(theta), 5, generator=generator, dtype=torch.float64)
        return theta[:, :1] * t + theta[:, 1:] + noise
