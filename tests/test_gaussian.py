"""Gaussian simulator, priors, balanced pairs and networks."""

import copy
import math

import numpy as np
import pytest
import torch

import gaussian
import networks
import nre_analysis
import nre_study
import priors
from gaussian import GaussianProblem
from gaussian_study import GaussianExperiment
from priors import make_prior
from settings import SettingsError
from settings_training import base_settings

pytestmark = pytest.mark.unit

PROBLEM = base_settings("smoke")["problem"]  # the documented defaults, as the bundled settings hold them
EXTREME_RATES = [1e-12, 0.1, -0.1, 5.0, -5.0, 1e3, -1e3]


def problem_settings(**changes):
    """A deep copy of the default problem settings with top-level changes."""
    settings = copy.deepcopy(PROBLEM)
    settings.update(copy.deepcopy(changes))
    return settings


def one_d(family="uniform", **override):
    """A 1-D mean-only problem and its prior, with overrides for mean:0."""
    problem = GaussianProblem.from_settings(problem_settings(overrides={"mean:0": override}))
    return problem, make_prior(problem, {"family": family})


def simpson(values, h):
    """Composite Simpson rule along the last axis (odd number of points)."""
    return (
        h / 3 * (values[..., 0] + values[..., -1] + 4 * values[..., 1:-1:2].sum(-1) + 2 * values[..., 2:-1:2].sum(-1))
    )


def density_on(prior, low, high, points=400_001):
    """Abscissae and 1-D density of the prior on a fine grid over [low, high]."""
    t = torch.linspace(low, high, points, dtype=torch.float64)
    return t, torch.exp(prior.log_prob(t[:, None])), (high - low) / (points - 1)


def full_settings():
    """A complete training settings dict for check_settings."""
    return {
        "problem": problem_settings(dimension=2, infer=["mean:*", "std:0"]),
        "cohort": {"priors": ["uniform", "mixed"], "replicas": 1},
        "priors": {
            "uniform": {"family": "uniform"},
            "mixed": {"family": "normal", "by_parameter": {"std:0": "grid"}},
            "unused": {"family": "bogus"},
        },
        "data": {"train": 1024, "validation": 256, "test": 256},
        "model": {"kind": "mlp", "hidden": [32, 32], "activation": "relu", "dropout": 0.0, "width": 64, "blocks": 2},
    }


# ---------------------------------------------------------------- problem settings


def test_infer_expansion_keeps_order_and_sets_bounds():
    problem = GaussianProblem.from_settings(problem_settings(dimension=3, infer=["std:*", "mean:1"]))
    assert problem.names == ["std:0", "std:1", "std:2", "mean:1"]
    assert problem.parameter_count == 4 and problem.dimension == 3
    assert problem.low.tolist() == [0.2, 0.2, 0.2, 0.0]
    assert problem.high.tolist() == [4.0, 4.0, 4.0, 10.0]
    assert problem.low.dtype == torch.float64 and problem.grid_step.tolist() == [0.2] * 4


def test_overrides_apply_per_name_only():
    problem = GaussianProblem.from_settings(
        problem_settings(dimension=2, infer=["mean:*"], overrides={"mean:0": {"high": 8.0, "exponential_rate": -0.3}})
    )
    assert problem.parameter("mean:0")["high"] == 8.0
    assert problem.parameter("mean:0")["exponential_rate"] == -0.3
    assert problem.parameter("mean:1")["high"] == 10.0
    assert problem.high.tolist() == [8.0, 10.0]
    description = problem.describe()
    assert description["fixed"] == {"std:0": 2.0, "std:1": 2.0}
    assert description["parameters"]["mean:0"]["high"] == 8.0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"infer": []}, r"^problem\.infer is empty"),
        ({"infer": ["mean:0", "mean:*"]}, r"^problem\.infer\[1\]: 'mean:\*' repeats 'mean:0'"),
        (
            {"dimension": 3, "infer": ["mean:7"]},
            r"^problem\.infer\[0\]: 'mean:7' is out of range for dimension 3 \(indices 0\.\.2\)",
        ),
        ({"infer": ["var:0"]}, r"^problem\.infer\[0\]: 'var:0' has unknown kind 'var'"),
        ({"infer": ["mean:x"]}, r"^problem\.infer\[0\]: 'mean:x' has a bad index"),
        ({"infer": "mean:*"}, r"^problem\.infer: expected a list"),
        ({"dimension": 0}, r"^problem\.dimension: expected an integer from 1 to 100"),
        ({"dimensions": 2}, r"^problem\.dimensions is not a known setting"),
        ({"fixed_std": 0.0}, r"^problem\.fixed_std: standard deviations must be > 0"),
        ({"fixed": {"std:0": -1.0}}, r"^problem\.fixed\.std:0: standard deviations must be > 0"),
        ({"fixed": {"mean:3": 1.0}}, r"^problem\.fixed: 'mean:3' is out of range"),
        (
            {"overrides": {"mean:0": {"high": -1.0}}},
            r"^problem\.parameters\.mean\.low=0\.0 must be below problem\.overrides\.mean:0\.high=-1\.0",
        ),
        ({"overrides": {"std:0": {"low": 0.0}}}, r"^problem\.overrides\.std:0\.low: standard deviations"),
        ({"overrides": {"mean:5": {"high": 1.0}}}, r"^problem\.overrides: 'mean:5' is out of range"),
        ({"overrides": {"mean:0": {"hgh": 1.0}}}, r"^problem\.overrides\.mean:0\.hgh is not a known setting"),
        (
            {"overrides": {"mean:0": {"grid_step": 20.0}}},
            r"^problem\.overrides\.mean:0\.grid_step=20\.0 does not fit the box",
        ),
        ({"overrides": {"mean:0": {"grid_step": 0.0}}}, r"^problem\.overrides\.mean:0\.grid_step=0\.0 does not fit"),
        ({"overrides": {"mean:0": {"normal_std": -2.0}}}, r"^problem\.overrides\.mean:0\.normal_std: must be > 0"),
        ({"overrides": {"mean:0": {"low": float("nan")}}}, r"^problem\.overrides\.mean:0\.low: expected a finite"),
    ],
)
def test_problem_errors_name_the_setting(changes, message):
    with pytest.raises(SettingsError, match=message):
        GaussianProblem.from_settings(problem_settings(**changes))


def test_std_low_bound_in_parameters_must_be_positive():
    settings = problem_settings()
    settings["parameters"]["std"]["low"] = 0.0
    with pytest.raises(SettingsError, match=r"^problem\.parameters\.std\.low: standard deviations must be > 0"):
        GaussianProblem.from_settings(settings)
    del settings["parameters"]["std"]
    with pytest.raises(SettingsError, match=r"^problem\.parameters\.std is missing"):
        GaussianProblem.from_settings(settings)


@pytest.mark.parametrize(
    "prior, message",
    [
        ({"family": "beta"}, r"^priors\.p\.family: 'beta' is not valid"),
        (
            {"family": "uniform", "by_parameter": {"std:0": "grid"}},
            r"^priors\.p\.by_parameter: 'std:0' is not an inferred parameter \(inferred: mean:0\)",
        ),
        (
            {"family": "uniform", "by_parameter": {"mean:0": "gird"}},
            r"^priors\.p\.by_parameter\.mean:0: 'gird' is not valid",
        ),
        ({"family": "uniform", "shape": 2}, r"^priors\.p\.shape is not a known setting"),
        ({}, r"^priors\.p\.family is missing"),
    ],
)
def test_prior_errors_name_the_setting(prior, message):
    problem = GaussianProblem.from_settings(problem_settings())
    with pytest.raises(SettingsError, match=message):
        make_prior(problem, prior, "priors.p")


def test_check_settings_accepts_valid_and_names_each_bad_setting():
    GaussianExperiment(full_settings()).validate()  # the unused bad prior is not checked
    cases = [
        (("cohort", "priors"), ["uniform", "missing"], r"^cohort\.priors\[1\]: 'missing' is not defined in priors"),
        (("cohort", "priors"), [], r"^cohort\.priors: expected a non-empty list"),
        (
            ("priors", "mixed"),
            {"family": "normal", "by_parameter": {"std:1": "grid"}},
            r"^priors\.mixed\.by_parameter: 'std:1' is not an inferred parameter",
        ),
        (("data", "train"), 1, r"^data\.train: expected an integer from 2 to 1e\+09, got 1"),
        (("data", "pairing"), "half", r"^data\.pairing: 'half' is not valid; use \"batch\""),
        (("data", "test"), 0, r"^data\.test: expected an integer from 2"),
        (("model", "input_size"), 3, r"^model\.input_size: the input size is derived"),
        (("model", "kind"), "cnn", r"^model\.kind: 'cnn' is not valid"),
        (("model", "activation"), "sigmoid", r"^model\.activation: 'sigmoid' is not valid"),
        (("model", "hidden"), [32, 0], r"^model\.hidden\[1\]: expected an integer from 1"),
        (("model", "dropout"), 1.0, r"^model\.dropout: must be in \[0, 1\)"),
        (("problem", "infer"), ["mean:2"], r"^problem\.infer\[0\]: 'mean:2' is out of range for dimension 2"),
    ]
    for (section, key), value, message in cases:
        settings = full_settings()
        settings[section][key] = value
        with pytest.raises(SettingsError, match=message):
            GaussianExperiment(settings).validate()


# ---------------------------------------------------------------- prior normalisation


@pytest.mark.parametrize(
    "family, override",
    [
        ("uniform", {}),
        ("normal", {}),
        ("normal", {"normal_mean": 100.0, "normal_std": 1.0}),  # box deep in the left tail
        ("normal", {"normal_mean": -60.0, "normal_std": 2.0}),  # box deep in the right tail
        ("normal", {"normal_mean": 5.0, "normal_std": 1e-2}),
    ]
    + [("exponential", {"exponential_rate": rate}) for rate in EXTREME_RATES],
)
def test_continuous_densities_integrate_to_one(family, override):
    problem, prior = one_d(family, **override)
    t, density, h = density_on(prior, 0.0, 10.0)
    assert torch.isfinite(density).all()
    assert simpson(density, h).item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("rate", EXTREME_RATES)
def test_exponential_sampling_finite_and_inside_for_extreme_rates(rate):
    problem, prior = one_d("exponential", exponential_rate=rate)
    draws = prior.sample(20_000, torch.Generator().manual_seed(1))[:, 0]
    assert torch.isfinite(draws).all() and (draws >= 0).all() and (draws <= 10).all()
    assert torch.isfinite(prior.log_prob(draws[:, None])).all()
    if abs(rate) >= 5:  # mass piles up at the decaying end, mean distance 1/|rate|
        distance = draws if rate > 0 else 10.0 - draws
        assert distance.mean().item() == pytest.approx(1 / abs(rate), rel=0.05)


@pytest.mark.parametrize(
    "override", [{"normal_mean": 100.0, "normal_std": 1.0}, {"normal_mean": -60.0, "normal_std": 2.0}]
)
def test_normal_sampling_stable_in_far_tails(override):
    problem, prior = one_d("normal", **override)
    draws = prior.sample(20_000, torch.Generator().manual_seed(2))[:, 0]
    assert torch.isfinite(draws).all() and (draws >= 0).all() and (draws <= 10).all()
    # The truncated tail is nearly exponential with rate |boundary z| / sigma at the near end.
    near = 10.0 if override["normal_mean"] > 10 else 0.0
    rate = abs(near - override["normal_mean"]) / override["normal_std"] ** 2
    assert (draws - near).abs().mean().item() == pytest.approx(1 / rate, rel=0.05)


def test_two_dimensional_product_density_integrates_to_one():
    problem = GaussianProblem.from_settings(problem_settings(infer=["mean:0", "std:0"]))
    prior = make_prior(problem, {"family": "exponential", "by_parameter": {"std:0": "normal"}})
    m = torch.linspace(0.0, 10.0, 801, dtype=torch.float64)
    s = torch.linspace(0.2, 4.0, 801, dtype=torch.float64)
    theta = torch.stack(torch.meshgrid(m, s, indexing="ij"), dim=-1)
    density = torch.exp(prior.log_prob(theta))
    inner = simpson(density, (s[1] - s[0]).item())
    assert simpson(inner, (m[1] - m[0]).item()).item() == pytest.approx(1.0, abs=1e-8)


def test_lattice_masses_sum_to_one():
    problem, prior = one_d("grid")
    support = prior.support(0)
    assert len(support) == 51 and support[0] == 0.0 and support[-1].item() == pytest.approx(10.0)
    masses = torch.exp(prior.log_prob(support[:, None]))
    assert masses.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert prior.log_prob(support[:, None])[0].item() == pytest.approx(-math.log(51))
    two = GaussianProblem.from_settings(problem_settings(infer=["mean:0", "std:0"]))
    grid = make_prior(two, {"family": "grid"})
    points = torch.cartesian_prod(grid.support(0), grid.support(1))
    assert len(grid.support(1)) == 20
    assert torch.exp(grid.log_prob(points)).sum().item() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------- sampler moments


def exact_moments(prior):
    """Mean, variance and fourth central moment of a 1-D prior from its log_prob."""
    if prior.lattice_steps[0] is not None:
        t = prior.support(0)
        weights = torch.exp(prior.log_prob(t[:, None]))
        integrate = lambda f: (f * weights).sum().item()  # noqa: E731
    else:
        t, density, h = density_on(prior, 0.0, 10.0, 200_001)
        integrate = lambda f: simpson(f * density, h).item()  # noqa: E731
    mean = integrate(t)
    variance = integrate((t - mean) ** 2)
    return mean, variance, integrate((t - mean) ** 4)


@pytest.mark.parametrize(
    "family, override",
    [
        ("uniform", {}),
        ("normal", {}),
        ("normal", {"normal_mean": 9.0, "normal_std": 0.5}),
        ("exponential", {"exponential_rate": 0.1}),
        ("exponential", {"exponential_rate": -0.7}),
        ("grid", {}),
        ("grid", {"grid_step": 0.3}),
    ],
)
def test_sampler_moments_match_log_prob(family, override):
    problem, prior = one_d(family, **override)
    n = 200_000
    draws = prior.sample(n, torch.Generator().manual_seed(3))[:, 0]
    mean, variance, fourth = exact_moments(prior)
    assert abs(draws.mean().item() - mean) < 5 * math.sqrt(variance / n)
    assert abs(draws.var().item() - variance) < 5 * math.sqrt((fourth - variance**2) / n)
    assert torch.isfinite(prior.log_prob(draws[:, None])).all()


# ---------------------------------------------------------------- log_prob support


@pytest.mark.parametrize("family", priors.FAMILIES)
def test_log_prob_is_minus_inf_off_support(family):
    problem, prior = one_d(family)
    bad = torch.tensor([-0.1, 10.1, -1e300, float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    assert (prior.log_prob(bad[:, None]) == -math.inf).all()
    assert torch.isfinite(prior.log_prob(torch.tensor([[0.0], [10.0]], dtype=torch.float64))).all()


def test_grid_log_prob_rejects_off_lattice_with_small_tolerance():
    problem, prior = one_d("grid")
    values = torch.tensor([[0.1], [0.2 + 1e-3], [0.2 + 1e-9], [3 * 0.2], [10.0 + 1e-9]], dtype=torch.float64)
    lp = prior.log_prob(values)
    assert lp[0] == -math.inf and lp[1] == -math.inf
    assert torch.isfinite(lp[2:]).all()


def test_by_parameter_mixes_families_per_coordinate():
    problem = GaussianProblem.from_settings(problem_settings(infer=["mean:0", "std:0"]))
    prior = make_prior(problem, {"family": "exponential", "by_parameter": {"std:0": "grid"}})
    assert prior.families == ["exponential", "grid"]
    assert prior.lattice_steps == [None, 0.2]
    with pytest.raises(ValueError, match="mean:0"):
        prior.support(0)
    draws = prior.sample(1000, torch.Generator().manual_seed(4))
    steps = (draws[:, 1] - 0.2) / 0.2
    assert torch.allclose(steps, steps.round(), atol=1e-9)  # lattice column
    assert len(torch.unique(draws[:, 0])) == 1000  # continuous column
    _, exponential = one_d("exponential")
    expected = exponential.log_prob(draws[:, :1]) - math.log(20)
    assert torch.allclose(prior.log_prob(draws), expected)
    assert prior.describe()["std:0"] == {"family": "grid", "low": 0.2, "high": 4.0, "grid_step": 0.2, "points": 20}


# ---------------------------------------------------------------- simulator


def test_log_likelihood_matches_direct_formula_with_broadcasting():
    problem = GaussianProblem.from_settings(problem_settings(dimension=2, infer=["mean:*", "std:1"]))
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(5, 1, 2, generator=generator, dtype=torch.float64) * 3 + 5
    theta = make_prior(problem, {"family": "uniform"}).sample(7, generator)[None]
    result = problem.log_likelihood(x, theta)
    assert result.shape == (5, 7)
    stds = torch.stack([torch.full((7,), 2.0, dtype=torch.float64), theta[0, :, 2]], -1)
    z = (x - theta[..., :2]) / stds
    direct = (-0.5 * z**2 - torch.log(stds) - 0.5 * math.log(2 * math.pi)).sum(-1)
    assert torch.allclose(result, direct)
    normal = torch.distributions.Normal(theta[..., :2], stds)
    assert torch.allclose(result, normal.log_prob(x).sum(-1))


def test_fixed_parameters_fill_the_rest_and_simulate_moments():
    problem = GaussianProblem.from_settings(
        problem_settings(dimension=2, infer=["mean:0", "std:1"], fixed_mean=7.0, fixed={"std:0": 0.5})
    )
    theta = torch.tensor([[1.0, 3.0]], dtype=torch.float64).expand(100_000, 2)
    means, stds = problem.means_and_stds(theta[:1])
    assert means.tolist() == [[1.0, 7.0]] and stds.tolist() == [[0.5, 3.0]]
    x = problem.simulate(theta, torch.Generator().manual_seed(6))
    assert x.shape == (100_000, 2) and x.dtype == torch.float64
    assert torch.allclose(x.mean(0), torch.tensor([1.0, 7.0], dtype=torch.float64), atol=0.05)
    assert torch.allclose(x.std(0), torch.tensor([0.5, 3.0], dtype=torch.float64), rtol=0.02)


# ---------------------------------------------------------------- training pairs


def z_scores(problem, inputs):
    """Standardised x given the theta in the same row."""
    inputs = torch.as_tensor(inputs, dtype=torch.float64)
    means, stds = problem.means_and_stds(inputs[:, problem.dimension :])
    return (inputs[:, : problem.dimension] - means) / stds


def test_balanced_pairs_joint_rows_consistent_product_rows_not():
    problem = GaussianProblem.from_settings(problem_settings(dimension=2, infer=["mean:*", "std:*"]))
    prior = make_prior(problem, {"family": "uniform"})
    inputs, labels = nre_study.sample_pairs(problem, prior, 8000, torch.Generator().manual_seed(7))
    assert inputs.shape == (8000, 6) and inputs.dtype == torch.float32
    assert labels.shape == (8000,) and labels.dtype == torch.float32
    assert labels.sum().item() == 4000 and set(labels.unique().tolist()) == {0.0, 1.0}
    assert 0 < labels[:4000].sum().item() < 4000  # shuffled, not joint-then-product
    z = z_scores(problem, inputs)
    joint, product = z[labels == 1], z[labels == 0]
    assert joint.mean().abs().item() < 0.05 and joint.std().item() == pytest.approx(1.0, abs=0.05)
    assert joint.abs().mean().item() == pytest.approx(math.sqrt(2 / math.pi), abs=0.03)
    assert product.abs().mean().item() > joint.abs().mean().item() + 0.5
    with pytest.raises(SettingsError, match="rows: expected a positive even"):
        nre_study.sample_pairs(problem, prior, 7, torch.Generator())


def test_training_data_is_deterministic_and_splits_independent():
    problem = GaussianProblem.from_settings(problem_settings())
    prior = make_prior(problem, {"family": "normal"})
    sizes = {"train": 64, "validation": 64, "test": 64}
    first = nre_study.sample_training_data(problem, prior, sizes, seed=11)
    again = nre_study.sample_training_data(problem, prior, sizes, seed=11)
    other = nre_study.sample_training_data(problem, prior, sizes, seed=12)
    assert sorted(first) == sorted(f"{s}_{k}" for s in ("train", "validation", "test") for k in ("x", "theta"))
    for key, array in first.items():
        assert isinstance(array, np.ndarray) and array.dtype == np.float32
        np.testing.assert_array_equal(array, again[key])
        assert not np.array_equal(array, other[key])
    assert first["train_x"].shape == (64, 1) and first["train_theta"].shape == (64, 1)
    assert not np.array_equal(first["train_x"], first["validation_x"])
    assert not np.array_equal(first["validation_theta"], first["test_theta"])
    # Every row is a joint simulation: x ~ N(θ, 2) at its own θ (the fixed std of problem_settings()).
    residual = (first["train_x"] - first["train_theta"]) / 2
    assert abs(residual.mean()) < 0.6 and 0.6 < residual.std() < 1.4
    # An odd split is fine for joint simulations; fixed pairs (the earlier meaning) keep halves.
    assert nre_study.sample_training_data(problem, prior, dict(sizes, train=3), seed=1)["train_x"].shape == (3, 1)
    fixed = nre_study.sample_training_data(problem, prior, dict(sizes, pairing="fixed"), seed=11)
    assert fixed["train_inputs"].shape == (64, 2) and fixed["test_labels"].sum() == 32
    with pytest.raises(SettingsError, match=r"^data\.validation: expected a positive even"):
        nre_study.sample_training_data(problem, prior, dict(sizes, validation=3, pairing="fixed"), seed=1)


def test_bayes_optimal_logit_normalises_over_an_exact_lattice_prior():
    problem, prior = one_d("grid")
    support = prior.support(0)
    x = torch.tensor([-2.0, 0.3, 5.0, 11.0], dtype=torch.float64)
    inputs = torch.cartesian_prod(x, support)  # every x against every lattice theta
    logit = nre_analysis.bayes_optimal_logits(problem, prior, inputs).reshape(4, len(support))
    posterior = torch.exp(logit - math.log(len(support)))  # prior mass times ratio
    assert torch.allclose(posterior.sum(1), torch.ones(4, dtype=torch.float64), atol=1e-12)
    # Monte Carlo evidence (continuous prior): mean ratio over product pairs is about one.
    problem, prior = one_d("uniform")
    inputs, labels = nre_study.sample_pairs(problem, prior, 2000, torch.Generator().manual_seed(8))
    ratio = torch.exp(nre_analysis.bayes_optimal_logits(problem, prior, inputs[labels == 0], draws=4000))
    assert ratio.mean().item() == pytest.approx(1.0, abs=0.1)


def direct_log_evidence(problem, x, points, log_weights):
    """log Σ w p(x|θ) straight from the likelihood, row by row (the reference for log_evidence)."""
    return torch.stack([torch.logsumexp(problem.log_likelihood(row, points) + log_weights, 0) for row in x])


@pytest.mark.parametrize("centre, spread", [(5.0, (0.2, 4.0)), (1e4, (0.01, 0.02))])
def test_log_evidence_matches_the_likelihood_also_far_from_zero(centre, spread):
    problem = GaussianProblem.from_settings(problem_settings(dimension=2, infer=["mean:*", "std:*"]))
    generator = torch.Generator().manual_seed(3)
    means = centre + torch.rand(300, 2, generator=generator, dtype=torch.float64)
    stds = spread[0] + (spread[1] - spread[0]) * torch.rand(300, 2, generator=generator, dtype=torch.float64)
    stds[7, 1] = 0.0  # an unusable point has no weight
    points = torch.cat([means, stds], 1)
    x = means[:130] + 2 * stds[:130] * torch.randn(130, 2, generator=generator, dtype=torch.float64)
    log_weights = torch.full((300,), -math.log(300), dtype=torch.float64)
    ours = gaussian.log_evidence(problem, x.float().double(), points, log_weights, rows=16)
    reference = direct_log_evidence(problem, x.float().double(), points, log_weights)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-9)
    # float32 x accepted; the same rows per block, so the same matrix shapes: bitwise on any CPU
    assert torch.equal(gaussian.log_evidence(problem, x.float(), points, log_weights, rows=16), ours)
    nothing = gaussian.log_evidence(problem, x[:3], points[:0], log_weights[:0])
    assert nothing.tolist() == [-math.inf] * 3


# ---------------------------------------------------------------- networks


def model(**changes):
    """Model settings with changes."""
    settings = {"kind": "mlp", "hidden": [32, 32], "activation": "relu", "dropout": 0.0, "width": 64, "blocks": 2}
    settings.update(changes)
    return settings


def count(network):
    """Number of trainable parameters."""
    return sum(p.numel() for p in network.parameters())


def test_network_shapes_and_parameter_counts():
    mlp = networks.build_network(model(), 2)
    assert count(mlp) == (2 * 32 + 32) + (32 * 32 + 32) + (32 + 1)
    assert mlp(torch.randn(5, 2)).shape == (5,)
    residual = networks.build_network(model(kind="residual", width=16, blocks=3), 3)
    assert count(residual) == (3 * 16 + 16) + 3 * 2 * (16 * 16 + 16) + (16 + 1)
    assert residual(torch.randn(4, 3)).shape == (4,)
    assert count(networks.build_network(model(kind="residual", width=16, blocks=0), 3)) == 64 + 17
    assert not any(isinstance(m, torch.nn.Dropout) for m in mlp.modules())


def test_a_residual_block_starts_as_the_identity_and_keeps_negative_values():
    torch.manual_seed(4)
    block = networks.ResidualBlock(16, "relu", 0.0)
    h = torch.randn(64, 16)
    out = block(h)
    assert (out - h).abs().max() < 0.05  # the branch's last layer starts near zero
    assert (out[h < -0.5] < 0).all()  # no activation on the identity path
    with torch.no_grad():
        block.outer.weight.zero_()
        block.outer.bias.zero_()
    assert torch.equal(block(h), h)


@pytest.mark.parametrize("kind", ["mlp", "residual"])
@pytest.mark.parametrize("name, module", [("relu", torch.nn.ReLU), ("tanh", torch.nn.Tanh), ("gelu", torch.nn.GELU)])
def test_activations(kind, name, module):
    network = networks.build_network(model(kind=kind, activation=name), 3)
    kinds = {type(m) for m in network.modules()}
    assert module in kinds and not ({torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU} - {module}) & kinds


@pytest.mark.parametrize("kind", ["mlp", "residual"])
def test_dropout_only_in_train_mode(kind):
    torch.manual_seed(9)
    network = networks.build_network(model(kind=kind, dropout=0.5), 3)
    inputs = torch.randn(16, 3)
    network.train()
    assert not torch.equal(network(inputs), network(inputs))
    network.eval()
    assert torch.equal(network(inputs), network(inputs))


def test_network_learns_the_ratio_on_tiny_data():
    problem, prior = one_d("uniform")
    torch.manual_seed(10)
    inputs, labels = nre_study.sample_pairs(problem, prior, 1024, torch.Generator().manual_seed(10))
    network = networks.build_network(model(hidden=[32, 32]), 2)
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-2)
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    for _ in range(100):
        optimizer.zero_grad()
        loss(network(inputs), labels).backward()
        optimizer.step()
    network.eval()
    held_out, held_labels = nre_study.sample_pairs(problem, prior, 1024, torch.Generator().manual_seed(11))
    with torch.no_grad():
        learned = loss(network(held_out), held_labels).item()
    optimal = loss(nre_analysis.bayes_optimal_logits(problem, prior, held_out, draws=2000).float(), held_labels).item()
    assert learned < math.log(2) - 0.1  # clearly better than chance
    assert learned < optimal + 0.05  # and close to the Bayes-optimal classifier
