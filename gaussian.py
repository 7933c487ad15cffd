"""The bundled Gaussian study: simulator, priors, balanced training pairs, networks."""

import math

import torch

import inference
import runtime

from settings import SettingsError, integer, known_keys, name_list, number, one_of, require

KINDS = ("mean", "std")
FAMILIES = ("uniform", "normal", "exponential", "grid")
PARAMETER_KEYS = ("low", "high", "normal_mean", "normal_std", "exponential_rate", "grid_step")
PROBLEM_KEYS = ("dimension", "infer", "fixed_mean", "fixed_std", "fixed", "parameters", "overrides")
MODEL_KEYS = ("kind", "hidden", "activation", "dropout", "width", "blocks")
SPLITS = ("train", "validation", "test")
ACTIVATIONS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU}
MAX_LATTICE_POINTS = 1_000_000
LATTICE_TOLERANCE = 1e-6  # in units of the step: float slack for "on the lattice"
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ---------------------------------------------------------------- validation helpers

# Magnitudes beyond these are surely typos, and would overflow the numerics downstream.
MAX_MAGNITUDE = 1e6
MAX_DIMENSION = 100
MAX_ROWS = 10**9
MAX_WIDTH = 1 << 16


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
        raise SettingsError(
            f"{path}: {text!r} is out of range for dimension {dimension} (indices 0..{dimension - 1})")
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
        self.grid_step = torch.tensor([self._parameters[n]["grid_step"] for n in self.names],
                                      dtype=torch.float64)
        # Which theta column fills which mean/std dimension.
        self._columns = {kind: [(c, int(n.split(":")[1])) for c, n in enumerate(self.names)
                                if n.startswith(kind + ":")] for kind in KINDS}

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
            base = torch.tensor([self._fixed[f"{kind}:{j}"] for j in range(self.dimension)],
                                dtype=torch.float64, device=theta.device)
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

    def describe(self):
        """JSON-able summary: dimension, inferred names with their settings, fixed values."""
        fixed = {name: value for name, value in self._fixed.items() if name not in self.names}
        return {"dimension": self.dimension, "names": list(self.names),
                "parameters": {name: dict(self._parameters[name]) for name in self.names},
                "fixed": fixed}


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
        raise SettingsError(f"{sources['low']}: standard deviations must be > 0, so the std low bound "
                            f"must be > 0, got {low}")
    if values["normal_std"] <= 0:
        raise SettingsError(f"{sources['normal_std']}: must be > 0, got {values['normal_std']}")
    if step <= 0 or step > high - low:
        raise SettingsError(f"{sources['grid_step']}={step} does not fit the box [{low}, {high}]; "
                            f"use a step in (0, {high - low}]")
    if inference.lattice_size(low, high, step) > MAX_LATTICE_POINTS:
        raise SettingsError(f"{sources['grid_step']}={step} gives more than {MAX_LATTICE_POINTS} "
                            f"lattice points on [{low}, {high}]; use a larger step")


# ---------------------------------------------------------------- one-coordinate priors

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
            self.count = inference.lattice_size(self.low, self.high, self.step)
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
        inside = torch.isfinite(t) & (t >= self.low) & (t <= self.high)
        if self.family == "uniform":
            lp = torch.full_like(t, -math.log(self.width))
        elif self.family == "normal":
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
            inside = (torch.isfinite(t) & (torch.abs(k - nearest) <= LATTICE_TOLERANCE)
                      & (nearest >= 0) & (nearest <= self.count - 1))
            lp = torch.full_like(t, -math.log(self.count))
        return torch.where(inside, lp, torch.full_like(lp, -math.inf))

    def sample(self, n, generator):
        """Draw n values by inverse CDF (or a uniform index for the lattice)."""
        if self.family == "grid":
            index = torch.randint(0, self.count, (n,), generator=generator)
            return self.low + index.to(torch.float64) * self.step
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
        return self.low + torch.arange(self.count, dtype=torch.float64) * self.step

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

    def __init__(self, problem, families):
        """Build the per-coordinate distributions from the problem's resolved settings."""
        self.problem = problem
        self.families = list(families)
        self._coordinates = [_Coordinate(f, problem.parameter(n)) for f, n in zip(families, problem.names)]
        self.lattice_steps = [c.step for c in self._coordinates]

    def support(self, j):
        """Lattice points of coordinate j (only for lattice coordinates)."""
        coordinate = self._coordinates[j]
        if coordinate.step is None:
            raise ValueError(f"prior coordinate {j} ({self.problem.names[j]}) is {coordinate.family}, "
                             f"not a lattice; it has no finite support")
        return coordinate.support()

    def coordinate_log_prob(self, j, values):
        """Log density (or lattice log mass) of coordinate j alone at the given values."""
        return self._coordinates[j].log_prob(torch.as_tensor(values, dtype=torch.float64))

    def sample(self, n, generator):
        """Draw n parameter rows (n, p) float64."""
        return torch.stack([c.sample(n, generator) for c in self._coordinates], dim=-1)

    def log_prob(self, theta):
        """Sum of per-coordinate log densities/masses of theta (..., p)."""
        theta = torch.as_tensor(theta, dtype=torch.float64)
        if theta.shape[-1:] != (len(self._coordinates),):
            raise ValueError(f"theta has shape {tuple(theta.shape)}; expected (..., {len(self._coordinates)})")
        return sum(c.log_prob(theta[..., j]) for j, c in enumerate(self._coordinates))

    def describe(self):
        """JSON-able description: one entry per inferred name."""
        return {name: c.describe() for name, c in zip(self.problem.names, self._coordinates)}


def make_prior(problem, prior_settings, path="prior"):
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
            raise SettingsError(f"{path}.by_parameter: {name!r} is not an inferred parameter "
                                f"(inferred: {', '.join(problem.names)})")
        families[name] = _family(value, f"{path}.by_parameter.{name}")
    return Prior(problem, [families[name] for name in problem.names])


def _family(value, path):
    """Check a family name."""
    return one_of(value, FAMILIES, path)


# ---------------------------------------------------------------- training data

def _check_rows(rows, path):
    """Split sizes are positive even integers (half joint, half product pairs)."""
    if integer(rows, path, 2, MAX_ROWS) % 2:
        raise SettingsError(f"{path}: expected a positive even number of rows, got {rows!r}")
    return rows


def sample_pairs(problem, prior, rows, generator):
    """Balanced, shuffled joint (label 1) and product (label 0) pairs: inputs [x, theta]."""
    half = _check_rows(rows, "rows") // 2
    theta_joint = prior.sample(half, generator)
    x_joint = problem.simulate(theta_joint, generator)
    theta_product = prior.sample(half, generator)
    x_product = problem.simulate(prior.sample(half, generator), generator)
    x = torch.cat([x_joint, x_product])
    theta = torch.cat([theta_joint, theta_product])
    labels = torch.cat([torch.ones(half), torch.zeros(half)])
    order = torch.randperm(rows, generator=generator)
    inputs = torch.cat([x, theta], dim=-1).to(torch.float32)
    return inputs[order], labels[order].to(torch.float32)


def sample_training_data(problem, prior, data_settings, seed):
    """Train/validation/test pairs as numpy arrays, each split from its own generator."""
    arrays = {}
    for split in SPLITS:
        rows = _check_rows(require(data_settings, split, "data"), f"data.{split}")
        generator = runtime.seeded_generator(seed, "split", split)
        inputs, labels = sample_pairs(problem, prior, rows, generator)
        arrays[f"{split}_inputs"] = inputs.numpy()
        arrays[f"{split}_labels"] = labels.numpy()
    return arrays


def _prior_points(prior, draws, seed):
    """Evidence quadrature: exact lattice enumeration when small, else Monte Carlo draws."""
    lattice = all(step is not None for step in prior.lattice_steps)
    if lattice:
        supports = [prior.support(j) for j in range(len(prior.families))]
        if math.prod(len(s) for s in supports) <= draws:
            points = torch.cartesian_prod(*supports).reshape(-1, len(supports))
            return points, prior.log_prob(points)
    points = prior.sample(draws, torch.Generator().manual_seed(seed))
    return points, torch.full((draws,), -math.log(draws), dtype=torch.float64)


def bayes_optimal_logit(problem, prior, inputs, draws=20_000, seed=0):
    """Reference logit log p(x|theta) - log E_prior p(x|theta') for inputs [x, theta] (rows, d+p)."""
    inputs = torch.as_tensor(inputs).detach().cpu().to(torch.float64)
    d = problem.dimension
    x, theta = inputs[:, :d], inputs[:, d:]
    points, log_weights = _prior_points(prior, draws, seed)
    return problem.log_likelihood(x, theta) - log_evidence(problem, x, points, log_weights)


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
        chunk = x[start:start + rows]
        block = buffer[:len(chunk)]
        torch.mm(chunk.square(), quadratic, out=block)
        block.addmm_(chunk, linear).add_(offset)
        peak = block.amax(1, keepdim=True).clamp_(min=torch.finfo(torch.float64).min)   # all -inf stays finite
        evidence[start:start + rows] = block.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))
    return evidence


# ---------------------------------------------------------------- networks

class MLP(torch.nn.Module):
    """Linear+activation per hidden width (optional dropout), then a Linear to one logit."""

    def __init__(self, input_size, hidden, activation, dropout):
        """Stack the layers."""
        super().__init__()
        layers, width = [], input_size
        for size in hidden:
            layers += [torch.nn.Linear(width, size), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(torch.nn.Dropout(dropout))
            width = size
        layers.append(torch.nn.Linear(width, 1))
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, inputs):
        """One logit per row, shape (rows,)."""
        return self.layers(inputs).squeeze(-1)


class ResidualBlock(torch.nn.Module):
    """act(h + Linear(dropout(act(Linear(h)))))."""

    def __init__(self, width, activation, dropout):
        """Two width-preserving Linear layers around an activation and dropout."""
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.outer = torch.nn.Linear(width, width)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, h):
        """Apply the block."""
        return self.activation(h + self.outer(self.dropout(self.activation(self.inner(h)))))


class ResidualNet(torch.nn.Module):
    """Input Linear to width (+activation), residual blocks, final Linear to one logit."""

    def __init__(self, input_size, width, blocks, activation, dropout):
        """Stack the input layer, blocks and output layer."""
        super().__init__()
        self.input = torch.nn.Sequential(torch.nn.Linear(input_size, width), ACTIVATIONS[activation]())
        self.blocks = torch.nn.Sequential(*[ResidualBlock(width, activation, dropout) for _ in range(blocks)])
        self.output = torch.nn.Linear(width, 1)

    def forward(self, inputs):
        """One logit per row, shape (rows,)."""
        return self.output(self.blocks(self.input(inputs))).squeeze(-1)


def check_model_settings(model, path="model"):
    """Validate the model section (the input size is derived, never configured)."""
    if not isinstance(model, dict):
        raise SettingsError(f"{path}: expected a dict, got {type(model).__name__}")
    if "input_size" in model:
        raise SettingsError(f"{path}.input_size: the input size is derived (d + p); remove this key")
    known_keys(model, MODEL_KEYS, path)
    kind = one_of(require(model, "kind", path), ("mlp", "residual"), f"{path}.kind")
    one_of(require(model, "activation", path), tuple(ACTIVATIONS), f"{path}.activation")
    if not 0.0 <= number(model.get("dropout", 0.0), f"{path}.dropout", 0.0, 1.0) < 1.0:
        raise SettingsError(f"{path}.dropout: must be in [0, 1), got {model['dropout']}")
    if kind == "mlp":
        hidden = require(model, "hidden", path)
        if not isinstance(hidden, (list, tuple)) or len(hidden) > 100:
            raise SettingsError(f"{path}.hidden: expected a list of up to 100 layer widths such as [32, 32]")
        for i, size in enumerate(hidden):
            integer(size, f"{path}.hidden[{i}]", 1, MAX_WIDTH)
    else:
        integer(require(model, "width", path), f"{path}.width", 1, MAX_WIDTH)
        integer(require(model, "blocks", path), f"{path}.blocks", 0, 1000)


def build_network(model_settings, input_size):
    """Build the classifier network for inputs of width input_size (= d + p)."""
    check_model_settings(model_settings)
    dropout = float(model_settings.get("dropout", 0.0))
    activation = model_settings["activation"]
    if model_settings["kind"] == "mlp":
        return MLP(input_size, list(model_settings["hidden"]), activation, dropout)
    return ResidualNet(input_size, model_settings["width"], model_settings["blocks"], activation, dropout)


# ---------------------------------------------------------------- whole-settings check

def check_settings(settings):
    """Validate problem, cohort, priors, data sizes and model; errors name the path."""
    problem = GaussianProblem.from_settings(require(settings, "problem", "settings"))
    cohort = require(settings, "cohort", "settings")
    known_keys(cohort, ("priors", "replicas"), "cohort")
    names = name_list(require(cohort, "priors", "cohort"), "cohort.priors", allow_empty=False)
    integer(require(cohort, "replicas", "cohort"), "cohort.replicas", 1, 1000)
    priors = require(settings, "priors", "settings")
    if not isinstance(priors, dict):
        raise SettingsError("priors: expected a dict of prior name -> definition")
    for i, name in enumerate(names):
        if not isinstance(name, str) or name not in priors:
            raise SettingsError(f"cohort.priors[{i}]: {name!r} is not defined in priors "
                                f"(defined: {', '.join(map(str, priors))})")
        make_prior(problem, priors[name], f"priors.{name}")
    data = require(settings, "data", "settings")
    known_keys(data, SPLITS, "data")
    for split in SPLITS:
        _check_rows(require(data, split, "data"), f"data.{split}")
    check_model_settings(require(settings, "model", "settings"))
