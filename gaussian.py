"""The bundled Gaussian simulator: a diagonal Gaussian in d dimensions, some of whose means and
standard deviations are inferred, the rest fixed (the `problem` section of settings_training.py).

Besides simulating and the exact likelihood it gives two analytic shortcuts the study kit
uses when a problem has them: the evidence of many observations at once (`log_evidence`)
and the posterior's rough size (`posterior_sds`, for plan's warnings).
"""

import math

import torch

import designs
from priors import PARAMETER_KEYS
from settings import SettingsError, integer, known_keys, number, require

__all__ = ["GaussianProblem", "log_evidence"]

KINDS = ("mean", "std")
PROBLEM_KEYS = ("dimension", "infer", "fixed_mean", "fixed_std", "fixed", "parameters", "overrides")
MAX_LATTICE_POINTS = 1_000_000
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ---------------------------------------------------------------- validation helpers

# Magnitudes beyond these are surely typos, and would overflow the numerics downstream.
MAX_MAGNITUDE = 1e6
MAX_DIMENSION = 100


def _number(value, path):
    """A finite float of sensible magnitude, or an error naming the setting."""
    return number(value, path, -MAX_MAGNITUDE, MAX_MAGNITUDE)


def _parse_name(text, dimension, path):
    """Split 'mean:j' / 'std:j' / 'mean:*' into (kind, index or None), checking range."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise SettingsError(f"{path}: {text!r} is not of the form 'mean:j', 'std:j', 'mean:*' or 'std:*'")
    kind, index = text.split(":")
    if kind not in KINDS:
        raise SettingsError(f"{path}: {text!r} has unknown kind {kind!r}; use 'mean' or 'std'")
    if index == "*":
        return kind, None
    if not index.isdigit():
        raise SettingsError(f"{path}: {text!r} has a bad index {index!r}; use a 0-based integer or '*'")
    if int(index) >= dimension:
        raise SettingsError(f"{path}: {text!r} is out of range for dimension {dimension} (indices 0..{dimension - 1})")
    return kind, int(index)


def _concrete_name(text, dimension, path):
    """Parse a single-parameter name ('*' not allowed) and return its canonical form."""
    kind, index = _parse_name(text, dimension, path)
    if index is None:
        raise SettingsError(f"{path}: {text!r} must name one parameter such as '{kind}:0', not '*'")
    return f"{kind}:{index}"


def expand_infer(infer, dimension, path="problem.infer"):
    """Expand the infer list into concrete names in order, rejecting duplicates."""
    if not isinstance(infer, (list, tuple)):
        raise SettingsError(f"{path}: expected a list such as ['mean:*'], got {infer!r}")
    if not infer:
        raise SettingsError(f"{path} is empty; list at least one parameter such as 'mean:*'")
    names = []
    for position, entry in enumerate(infer):
        kind, index = _parse_name(entry, dimension, f"{path}[{position}]")
        indices = range(dimension) if index is None else [index]
        for j in indices:
            name = f"{kind}:{j}"
            if name in names:
                raise SettingsError(f"{path}[{position}]: {entry!r} repeats {name!r}, already inferred")
            names.append(name)
    return names


# ---------------------------------------------------------------- the simulator


class GaussianProblem:
    """Diagonal Gaussian in d dimensions with some means/stds inferred, the rest fixed."""

    def __init__(self, dimension, names, fixed_values, parameters):
        """Store the resolved problem; use from_settings to build one from settings."""
        self.dimension = dimension
        self.names = list(names)
        self.parameter_count = len(self.names)
        self._fixed = dict(fixed_values)  # every mean:j / std:j -> value used when not inferred
        self._parameters = {name: dict(values) for name, values in parameters.items()}
        self.low = torch.tensor([self._parameters[n]["low"] for n in self.names], dtype=torch.float64)
        self.high = torch.tensor([self._parameters[n]["high"] for n in self.names], dtype=torch.float64)
        self.grid_step = torch.tensor([self._parameters[n]["grid_step"] for n in self.names], dtype=torch.float64)
        # Which theta column fills which mean/std dimension.
        self._columns = {
            kind: [(c, int(n.split(":")[1])) for c, n in enumerate(self.names) if n.startswith(kind + ":")]
            for kind in KINDS
        }

    @classmethod
    def from_settings(cls, settings, path="problem"):
        """Validate the problem settings and build the problem."""
        if not isinstance(settings, dict):
            raise SettingsError(f"{path}: expected a dict, got {type(settings).__name__}")
        known_keys(settings, PROBLEM_KEYS, path)
        dimension = integer(require(settings, "dimension", path), f"{path}.dimension", 1, MAX_DIMENSION)
        names = expand_infer(require(settings, "infer", path), dimension, f"{path}.infer")
        fixed_values = _fixed_values(settings, dimension, path)
        parameters = _resolved_parameters(settings, dimension, path)
        return cls(dimension, names, fixed_values, parameters)

    def parameter(self, name):
        """Resolved bounds and prior hyper-parameters of one inferred parameter."""
        if name not in self.names:
            raise KeyError(f"{name!r} is not inferred; inferred parameters: {', '.join(self.names)}")
        return dict(self._parameters[name])

    def means_and_stds(self, theta):
        """Map theta (..., p) to per-dimension means and stds (..., d), fixed values filled in."""
        theta = torch.as_tensor(theta, dtype=torch.float64)
        if theta.shape[-1:] != (self.parameter_count,):
            raise ValueError(f"theta has shape {tuple(theta.shape)}; expected (..., {self.parameter_count})")
        batch = theta.shape[:-1]
        result = []
        for kind in KINDS:
            base = torch.tensor(
                [self._fixed[f"{kind}:{j}"] for j in range(self.dimension)], dtype=torch.float64, device=theta.device
            )
            values = base.expand(*batch, self.dimension).clone()
            for column, j in self._columns[kind]:
                values[..., j] = theta[..., column]
            result.append(values)
        return result[0], result[1]

    def simulate(self, theta, generator):
        """Draw one observation x (..., d) per parameter row theta (..., p)."""
        means, stds = self.means_and_stds(theta)
        noise = torch.randn(means.shape, generator=generator, dtype=torch.float64, device=means.device)
        return means + stds * noise

    def log_likelihood(self, x, theta):
        """Exact log p(x | theta), broadcasting x (..., d) against theta (..., p)."""
        means, stds = self.means_and_stds(theta)
        x = torch.as_tensor(x, dtype=torch.float64, device=means.device)
        positive = stds > 0
        safe = torch.where(positive, stds, torch.ones_like(stds))
        z = (x - means) / safe
        terms = -0.5 * z * z - torch.log(safe) - _HALF_LOG_2PI
        terms = torch.where(positive, terms, torch.full_like(terms, -math.inf))
        return terms.sum(-1)

    def log_evidence(self, x, points, log_weights):
        """log Σ_k w_k p(x | θ_k) for every row of x, computed as two matrix products (see log_evidence)."""
        return log_evidence(self, x, points, log_weights)

    def posterior_sds(self, observations):
        """Posterior sds of the inferred parameters, Gaussian approximation at the box centre.

        From m observations a mean is known to std/√m, a std to std/√(2m).
        """
        _, stds = self.means_and_stds((self.low + self.high) / 2)
        return torch.tensor(
            [
                float(stds[int(name.split(":")[1])]) / math.sqrt(observations * (1 + name.startswith("std:")))
                for name in self.names
            ],
            dtype=torch.float64,
        )

    def describe(self):
        """JSON-able summary: dimension, inferred names with their settings, fixed values."""
        fixed = {name: value for name, value in self._fixed.items() if name not in self.names}
        return {
            "dimension": self.dimension,
            "names": list(self.names),
            "parameters": {name: dict(self._parameters[name]) for name in self.names},
            "fixed": fixed,
        }


def _fixed_values(settings, dimension, path):
    """Fixed value of every mean:j/std:j from fixed_mean/fixed_std and the per-name dict."""
    fixed_mean = _number(require(settings, "fixed_mean", path), f"{path}.fixed_mean")
    fixed_std = _number(require(settings, "fixed_std", path), f"{path}.fixed_std")
    if fixed_std <= 0:
        raise SettingsError(f"{path}.fixed_std: standard deviations must be > 0, got {fixed_std}")
    values = {f"mean:{j}": fixed_mean for j in range(dimension)}
    values.update({f"std:{j}": fixed_std for j in range(dimension)})
    per_name = settings.get("fixed", {})
    if not isinstance(per_name, dict):
        raise SettingsError(f"{path}.fixed: expected a dict such as {{'std:0': 1.5}}, got {per_name!r}")
    for key, value in per_name.items():
        name = _concrete_name(key, dimension, f"{path}.fixed")
        number = _number(value, f"{path}.fixed.{key}")
        if name.startswith("std:") and number <= 0:
            raise SettingsError(f"{path}.fixed.{key}: standard deviations must be > 0, got {number}")
        values[name] = number
    return values


def _resolved_parameters(settings, dimension, path):
    """Bounds/hyper-parameters for every mean:j/std:j after overrides, all validated."""
    base = require(settings, "parameters", path)
    for kind in KINDS:
        kind_settings = require(base, kind, f"{path}.parameters")
        known_keys(kind_settings, PARAMETER_KEYS, f"{path}.parameters.{kind}")
        for key in PARAMETER_KEYS:
            _number(require(kind_settings, key, f"{path}.parameters.{kind}"), f"{path}.parameters.{kind}.{key}")
    overrides = settings.get("overrides", {})
    if not isinstance(overrides, dict):
        raise SettingsError(f"{path}.overrides: expected a dict such as {{'mean:0': {{'high': 8.0}}}}")
    canonical = {}
    for key, values in overrides.items():
        name = _concrete_name(key, dimension, f"{path}.overrides")
        if not isinstance(values, dict):
            raise SettingsError(f"{path}.overrides.{key}: expected a dict of {', '.join(PARAMETER_KEYS)}")
        known_keys(values, PARAMETER_KEYS, f"{path}.overrides.{key}")
        canonical[name] = (key, values)
    resolved = {}
    for kind in KINDS:
        for j in range(dimension):
            name = f"{kind}:{j}"
            key, override = canonical.get(name, (name, {}))
            sources, values = {}, {}
            for field in PARAMETER_KEYS:
                if field in override:
                    sources[field] = f"{path}.overrides.{key}.{field}"
                    values[field] = _number(override[field], sources[field])
                else:
                    sources[field] = f"{path}.parameters.{kind}.{field}"
                    values[field] = float(base[kind][field])
            _check_parameter(kind, values, sources)
            resolved[name] = values
    return resolved


def _check_parameter(kind, values, sources):
    """Check one parameter's box, prior scale and lattice step; messages name the source."""
    low, high, step = values["low"], values["high"], values["grid_step"]
    if low >= high:
        raise SettingsError(f"{sources['low']}={low} must be below {sources['high']}={high}")
    if kind == "std" and low <= 0:
        raise SettingsError(
            f"{sources['low']}: standard deviations must be > 0, so the std low bound must be > 0, got {low}"
        )
    if values["normal_std"] <= 0:
        raise SettingsError(f"{sources['normal_std']}: must be > 0, got {values['normal_std']}")
    if step <= 0 or step > high - low:
        raise SettingsError(
            f"{sources['grid_step']}={step} does not fit the box [{low}, {high}]; use a step in (0, {high - low}]"
        )
    if designs.lattice_size(low, high, step) > MAX_LATTICE_POINTS:
        raise SettingsError(
            f"{sources['grid_step']}={step} gives more than {MAX_LATTICE_POINTS} "
            f"lattice points on [{low}, {high}]; use a larger step"
        )


# ---------------------------------------------------------------- analytic shortcuts


def log_evidence(problem, x, points, log_weights, rows=64):
    """log Σ_k w_k p(x | θ_k) for every row of x (n, d), over weighted points θ_k.

    The Gaussian log-likelihood is a quadratic in x, so each block of rows is two matrix
    products into one buffer, reduced in place: the loop allocates nothing large. (Fresh
    rows x points temporaries on every block let glibc's heap grow by gigabytes, depending
    on where the address layout put it.)
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    if len(points) == 0:
        return torch.full((len(x),), -math.inf, dtype=torch.float64)
    means, stds = problem.means_and_stds(points)
    usable = (stds > 0).all(-1)
    precision = torch.where(stds > 0, stds, torch.ones_like(stds)).reciprocal().square()
    # Centred, so that the expanded quadratic does not cancel large terms when |μ| >> σ.
    centre = means.mean(0)
    x, means = x - centre, means - centre
    # log p(x|θ) = -½ x²·a + x·b + c with a = 1/σ², b = μ/σ², c = Σ(-½ μ²/σ² - log σ) - d·log √(2π)
    offset = (-0.5 * means.square() * precision + 0.5 * precision.log()).sum(-1) - problem.dimension * _HALF_LOG_2PI
    offset = torch.where(usable, offset + log_weights, torch.full_like(offset, -math.inf))
    quadratic, linear = -0.5 * precision.T, (means * precision).T
    buffer = torch.empty(min(rows, len(x)), len(points), dtype=torch.float64)
    evidence = torch.empty(len(x), dtype=torch.float64)
    for start in range(0, len(x), rows):
        chunk = x[start : start + rows]
        block = buffer[: len(chunk)]
        torch.mm(chunk.square(), quadratic, out=block)
        block.addmm_(chunk, linear).add_(offset)
        peak = block.amax(1, keepdim=True).clamp_(min=torch.finfo(torch.float64).min)  # all -inf stays finite
        evidence[start : start + rows] = block.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))
    return evidence
