"""Bundled prior families for any study: independent coordinates, each uniform, normal,
exponential or a lattice ("grid") on its parameter's box.

A prior setting reads `{"family": "normal"}`, optionally with `"by_parameter": {"b": "grid"}`
to give single parameters another family. The hyper-parameters of each parameter
(`low`, `high`, `normal_mean`, `normal_std`, `exponential_rate`, `grid_step`) come from
the study's `problem.parameter(name)`. A study may also give its own prior object: anything
with `sample(n, generator) -> (n, p)` and `log_prob(theta) -> (...)` (see `custom_prior`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

import designs
from settings import SettingsError, known_keys, one_of, require

if TYPE_CHECKING:  # annotations only
    from study import Json, PriorContract, ProblemContract

__all__ = ["FAMILIES", "PARAMETER_KEYS", "Prior", "make_prior", "CustomPrior", "quadrature_points"]

FAMILIES = ("uniform", "normal", "exponential", "grid")
PARAMETER_KEYS = ("low", "high", "normal_mean", "normal_std", "exponential_rate", "grid_step")
LATTICE_TOLERANCE = 1e-6  # in units of the step: float slack for "on the lattice"
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ---------------------------------------------------------------- special functions
def _log1mexp(d):
    """log(1 - exp(d)) for d <= 0, accurate on both sides of -log 2."""
    if d > -math.log(2.0):
        return math.log(-math.expm1(d))
    return math.log1p(-math.exp(d))


def _log_ndtr(value):
    """log Phi(value) for a Python float."""
    return float(torch.special.log_ndtr(torch.tensor(value, dtype=torch.float64)))


def _ndtri_from_log(log_p):
    """Standard normal quantile from log p, accurate even when p underflows."""
    z = torch.special.ndtri(torch.exp(log_p))
    tail = log_p < -600.0  # exp(log_p) is near or below the smallest double
    if bool(tail.any()):
        target = log_p[tail]
        zt = -torch.sqrt(-2.0 * target)
        for _ in range(8):  # Newton on log Phi, which is concave: converges quickly
            log_phi = torch.special.log_ndtr(zt)
            slope = torch.exp(-0.5 * zt * zt - _HALF_LOG_2PI - log_phi)
            zt = zt - (log_phi - target) / slope
        z = z.clone()
        z[tail] = zt
    return z


class _Coordinate:
    """One prior coordinate: its family, box and the constants its formulas need."""

    def __init__(self, family, values):
        """Precompute normalising constants for the family on [low, high]."""
        self.family = family
        self.low, self.high = values["low"], values["high"]
        self.width = self.high - self.low
        self.step = values["grid_step"] if family == "grid" else None
        self.rate = values["exponential_rate"]
        self.mu, self.sigma = values["normal_mean"], values["normal_std"]
        if family == "grid":
            self.count = designs.lattice_size(self.low, self.high, values["grid_step"])
        elif family == "normal":
            a, b = (self.low - self.mu) / self.sigma, (self.high - self.mu) / self.sigma
            # Work on the side of the mean where the mass is, so Phi differences do not cancel.
            self.flip = a > 0
            self.a, self.b = (-b, -a) if self.flip else (a, b)
            self.log_phi_a, self.log_phi_b = _log_ndtr(self.a), _log_ndtr(self.b)
            self.log_z = self.log_phi_b + _log1mexp(self.log_phi_a - self.log_phi_b)
        elif family == "exponential":
            self.abs_rate = abs(self.rate)
            # |rate|*width this small is uniform to double precision (and avoids 0/0).
            self.flat = self.abs_rate * self.width < 1e-300
            if not self.flat:
                self.log_norm = math.log(self.abs_rate) - _log1mexp(-self.abs_rate * self.width)

    def _decay_distance(self, t):
        """Distance from the end the exponential density decays away from."""
        return t - self.low if self.rate > 0 else self.high - t

    def log_prob(self, t):
        """Log density (continuous) or log mass (lattice) of values t; -inf off the support."""
        inside = (t >= self.low) & (t <= self.high)  # NaN fails both; ±inf fail one (the bounds are finite)
        if self.family == "uniform":
            return torch.full_like(t, -math.inf).masked_fill_(inside, -math.log(self.width))
        if self.family == "normal":
            z = (t - self.mu) / self.sigma
            lp = -0.5 * z * z - _HALF_LOG_2PI - math.log(self.sigma) - self.log_z
        elif self.family == "exponential":
            if self.flat:
                lp = torch.full_like(t, -math.log(self.width))
            else:
                lp = self.log_norm - self.abs_rate * self._decay_distance(t)
        else:
            k = (t - self.low) / self.step
            nearest = torch.round(k)
            inside = (
                torch.isfinite(t)
                & (torch.abs(k - nearest) <= LATTICE_TOLERANCE)
                & (nearest >= 0)
                & (nearest <= self.count - 1)
            )
            lp = torch.full_like(t, -math.log(self.count))
        return torch.where(inside, lp, torch.full_like(lp, -math.inf))

    def sample(self, n, generator):
        """Draw n values by inverse CDF (or a uniform index for the lattice)."""
        if self.family == "grid":
            index = torch.randint(0, self.count, (n,), generator=generator)
            return self.low + index.to(torch.float64) * self.grid_step()
        u = torch.rand(n, generator=generator, dtype=torch.float64)  # in [0, 1)
        if self.family == "uniform" or (self.family == "exponential" and self.flat):
            t = self.low + self.width * u
        elif self.family == "normal":
            log_p = torch.logaddexp(self.log_phi_a + torch.log1p(-u), self.log_phi_b + torch.log(u))
            z = _ndtri_from_log(log_p).clamp(self.a, self.b)
            t = self.mu + self.sigma * (-z if self.flip else z)
        else:
            s = -torch.log1p(u * math.expm1(-self.abs_rate * self.width)) / self.abs_rate
            s = s.clamp(0.0, self.width)
            t = self.low + s if self.rate > 0 else self.high - s
        return t.clamp(self.low, self.high)

    def support(self):
        """Lattice points of a grid coordinate."""
        return self.low + torch.arange(self.count, dtype=torch.float64) * self.grid_step()

    def grid_step(self) -> float:
        """The lattice step of a grid coordinate."""
        if self.step is None:
            raise ValueError(f"a {self.family} coordinate has no lattice step")
        return self.step

    def describe(self):
        """JSON-able description of this coordinate's distribution."""
        info = {"family": self.family, "low": self.low, "high": self.high}
        if self.family == "normal":
            info.update(normal_mean=self.mu, normal_std=self.sigma)
        elif self.family == "exponential":
            info.update(exponential_rate=self.rate)
        elif self.family == "grid":
            info.update(grid_step=self.step, points=self.count)
        return info


# ---------------------------------------------------------------- the joint prior


class Prior:
    """Independent prior over the inferred parameters, one family per coordinate."""

    def __init__(self, problem: ProblemContract, families: list[str]) -> None:
        """Build the per-coordinate distributions from the problem's resolved settings."""
        self.problem = problem
        self.families = list(families)
        self._coordinates = [_Coordinate(f, problem.parameter(n)) for f, n in zip(families, problem.names)]
        self.lattice_steps = [c.step for c in self._coordinates]

    def support(self, j: int) -> torch.Tensor:
        """Lattice points of coordinate j (only for lattice coordinates)."""
        coordinate = self._coordinates[j]
        if coordinate.step is None:
            raise ValueError(
                f"prior coordinate {j} ({self.problem.names[j]}) is {coordinate.family}, "
                f"not a lattice; it has no finite support"
            )
        return coordinate.support()

    def coordinate_log_prob(self, j: int, values: Any) -> torch.Tensor:
        """Log density (or lattice log mass) of coordinate j alone at the given values."""
        return self._coordinates[j].log_prob(torch.as_tensor(values, dtype=torch.float64))

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Draw n parameter rows (n, p) float64."""
        return torch.stack([c.sample(n, generator) for c in self._coordinates], dim=-1)

    def log_prob(self, theta: Any) -> torch.Tensor:
        """Sum of per-coordinate log densities/masses of theta (..., p)."""
        theta = torch.as_tensor(theta, dtype=torch.float64)
        if theta.shape[-1:] != (len(self._coordinates),):
            raise ValueError(f"theta has shape {tuple(theta.shape)}; expected (..., {len(self._coordinates)})")
        if self._inside_uniform_box(theta):
            # One constant: the coordinates' −log widths summed in order, as the sum below does.
            log_density = 0.0
            for c in self._coordinates:
                log_density += -math.log(c.width)
            return torch.full(theta.shape[:-1], log_density, dtype=torch.float64, device=theta.device)
        total = self._coordinates[0].log_prob(theta[..., 0])
        for j, coordinate in enumerate(self._coordinates[1:], start=1):
            total += coordinate.log_prob(theta[..., j])  # each coordinate's result is a fresh tensor
        return total

    def _inside_uniform_box(self, theta):
        """Whether the prior is uniform on every coordinate and all values lie inside its box (an
        analysis' candidates do): their log density is then one constant, with no comparison
        value by value (NaN fails)."""
        if not theta.numel() or any(c.family != "uniform" for c in self._coordinates):
            return False
        rows = theta if theta.dim() > 1 else theta[None]
        leading = tuple(range(rows.dim() - 1))
        lowest, highest = torch.stack([rows.amin(dim=leading), rows.amax(dim=leading)]).cpu()
        lows, highs = torch.tensor([[c.low, c.high] for c in self._coordinates], dtype=torch.float64).T
        return bool((lowest >= lows).all() and (highest <= highs).all())

    def describe(self) -> Json:
        """JSON-able description: one entry per inferred name."""
        return {name: c.describe() for name, c in zip(self.problem.names, self._coordinates)}


def make_prior(problem: ProblemContract, prior_settings: Any, path: str = "prior") -> Prior:
    """Validate one prior definition ({'family', optional 'by_parameter'}) and build it."""
    if not isinstance(prior_settings, dict):
        raise SettingsError(f"{path}: expected a dict such as {{'family': 'uniform'}}, got {prior_settings!r}")
    known_keys(prior_settings, ("family", "by_parameter"), path)
    family = _family(require(prior_settings, "family", path), f"{path}.family")
    families = {name: family for name in problem.names}
    by_parameter = prior_settings.get("by_parameter", {})
    if not isinstance(by_parameter, dict):
        raise SettingsError(f"{path}.by_parameter: expected a dict such as {{'std:0': 'uniform'}}")
    for name, value in by_parameter.items():
        if name not in problem.names:
            raise SettingsError(
                f"{path}.by_parameter: {name!r} is not an inferred parameter (inferred: {', '.join(problem.names)})"
            )
        families[name] = _family(value, f"{path}.by_parameter.{name}")
    for name, family in families.items():
        if family == "grid" and problem.parameter(name)["grid_step"] is None:
            raise SettingsError(
                f"{path}: the 'grid' family needs a lattice step for {name!r}; declare the "
                "parameter as (low, high, step), or choose another family"
            )
    return Prior(problem, [families[name] for name in problem.names])


def _family(value, path):
    """Check a family name."""
    return one_of(value, FAMILIES, path)


# ---------------------------------------------------------------- a study's own prior object


class CustomPrior:
    """A study's own prior object, given what the analysis reads of a prior.

    The object needs `sample(n, generator)` (float64 (n, p)) and `log_prob(theta)`; its
    axes are continuous unless it says otherwise with `lattice_steps`.
    """

    def __init__(self, prior: Any, names: list[str]) -> None:
        """Wrap `prior`, checking it has the two methods."""
        for method in ("sample", "log_prob"):
            if not callable(getattr(prior, method, None)):
                raise SettingsError(
                    f"priors: {type(prior).__name__} lacks {method}(); a prior object needs "
                    "sample(n, generator) and log_prob(theta)"
                )
        self.prior = prior
        self.names = list(names)
        self.lattice_steps = list(getattr(prior, "lattice_steps", [None] * len(self.names)))

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n parameter rows (n, p) float64."""
        return torch.as_tensor(self.prior.sample(n, generator), dtype=torch.float64).reshape(n, len(self.names))

    def log_prob(self, theta: Any) -> torch.Tensor:
        """The object's log density at theta (..., p)."""
        return torch.as_tensor(self.prior.log_prob(torch.as_tensor(theta, dtype=torch.float64)), dtype=torch.float64)

    def describe(self) -> Json:
        """The object's own describe(), or its class and repr."""
        if callable(getattr(self.prior, "describe", None)):
            return self.prior.describe()
        cls = type(self.prior)
        info = {"object": f"{cls.__module__}.{cls.__qualname__}"}
        if cls.__repr__ is not object.__repr__:  # object's own repr holds an address: a new key every launch
            info["repr"] = repr(self.prior)
        return info


def quadrature_points(prior: PriorContract, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points and log weights that integrate over the prior: its lattice when small, else draws."""
    if all(step is not None for step in prior.lattice_steps) and hasattr(prior, "support"):
        supports = [prior.support(j) for j in range(len(prior.lattice_steps))]
        if math.prod(len(s) for s in supports) <= draws:
            points = torch.cartesian_prod(*supports).reshape(-1, len(supports))
            return points, prior.log_prob(points)
    points = prior.sample(draws, torch.Generator().manual_seed(seed))
    return points, torch.full((draws,), -math.log(draws), dtype=torch.float64)
