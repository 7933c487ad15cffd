"""The posterior sampler against exact posterior draws, judged by the classifier two-sample test (C2ST).

The posteriors here are built by posterior.from_scores, the path a trained model's takes
(for_observation), with the exact likelihood in place of the network, so what is tested is
the candidate design and the sampler (sampler.py) alone.
"""

import math
import types
import warnings

import pytest
import torch

import posterior as post
import sampler
import settings_analysis
from c2st import c2st

BOX = 5.0  # prior sds either side of the prior's mean: the truncation is negligible
DRAWS = 2000


def box_problem(p, half=BOX):
    """The names and box a posterior needs, for p parameters on [−half, half]^p."""
    bound = torch.full((p,), float(half), dtype=torch.float64)
    return types.SimpleNamespace(names=[f"theta{j}" for j in range(p)], low=-bound, high=bound)


def normal_prior_scores(log_likelihood, half=BOX):
    """A score function of the analysis' targets: the log-likelihood (ratio) and, under a standard normal
    prior truncated to the box, the unnormalised log posterior (−inf outside the box)."""

    def score_fn(theta):
        ratio = log_likelihood(theta)
        inside = (theta.abs() <= half).all(dim=1)
        prior = torch.where(inside, -0.5 * (theta * theta).sum(dim=1), torch.tensor(-math.inf, dtype=torch.float64))
        return {"ratio": ratio, "posterior": ratio + prior}

    return score_fn


def adaptive_settings(candidate_count, coarse_count, stages):
    """The default analysis settings with an adaptive design of this size."""
    analysis = settings_analysis.make_settings("default")
    analysis["inference"]["candidates"].update(
        kind="adaptive", candidate_count=candidate_count, coarse_count=coarse_count, refinement_stages=stages
    )
    return analysis


def old_resampling(posterior, n, seed=0):
    """Importance resampling: the candidates drawn with replacement by their masses (what sample() did before
    it drew fresh points)."""
    index = torch.multinomial(posterior.masses, n, replacement=True, generator=torch.Generator().manual_seed(seed))
    return posterior.points[index]


# ---------------------------------------------------------------- a linear Gaussian in ten parameters

SIGMA = 1.0  # x = θ + N(0, σ²): the posterior sd σ/√(1 + σ²) ≈ 0.71 of the prior's 1
X10 = torch.tensor([0.8, -1.1, 0.3, 1.9, -0.4, 0.0, -2.0, 1.2, 0.5, -0.7], dtype=torch.float64)


def gaussian_posterior():
    """The ten-parameter linear Gaussian's posterior on 16,384 adaptive candidates, five refined passes: more
    effective candidates than the default design's, so the old resampling has its best chance."""
    score_fn = normal_prior_scores(lambda theta: -0.5 * (((X10 - theta) / SIGMA) ** 2).sum(dim=1))
    return post.from_scores(box_problem(10), [None] * 10, score_fn, adaptive_settings(16384, 1024, 5), seed=1)


def gaussian_reference(n, seed):
    """Exact i.i.d. draws of that posterior, N(x/(1 + σ²), σ²/(1 + σ²)) per axis: the box lies more than five
    posterior sds from every mean, so its cut (under 1e-7 of the mass) is left out."""
    scale = 1 / (1 + SIGMA**2)
    noise = torch.randn(n, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return X10 * scale + SIGMA * math.sqrt(scale) * noise


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as analyses run: small operations stay fast on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gaussian(one_thread):
    """The ten-parameter posterior, built once."""
    return gaussian_posterior()


@pytest.mark.unit
def test_the_sampler_matches_exact_draws_of_a_ten_parameter_gaussian_where_resampling_does_not(gaussian):
    draws = gaussian.sample(DRAWS, seed=0)
    assert gaussian.sampling["method"] == "rejection" and gaussian.sampling["warning"] is None
    reference = gaussian_reference(DRAWS, seed=5)
    score = c2st(draws, reference)
    assert score <= 0.55, score
    # The same exact posterior resampled from the candidates: a few hundred effective points, repeated.
    old = old_resampling(gaussian, DRAWS)
    assert torch.unique(old, dim=0).shape[0] < DRAWS / 2
    assert c2st(old, reference) > score + 0.15


@pytest.mark.unit
def test_the_rejection_sampler_needs_only_enough_effective_candidates_to_place_its_proposal():
    # The analysis' default design (1,024·p points, a coarse pass of 128·p): too few effective candidates
    # to resample them, enough to place the proposal; rejection keeps the draws exact.
    score_fn = normal_prior_scores(lambda theta: -0.5 * (((X10 - theta) / SIGMA) ** 2).sum(dim=1))
    sparse = post.from_scores(box_problem(10), [None] * 10, score_fn, adaptive_settings(10240, 1280, 3), seed=2)
    assert sparse.ess < post.MIN_ESS
    draws = sparse.sample(DRAWS, seed=0)
    assert sparse.sampling["method"] == "rejection" and sparse.sampling["warning"] is None
    assert c2st(draws, gaussian_reference(DRAWS, seed=6)) <= 0.55
    # {}: every inference key at its default, as `infer` right after `train` has it: a larger design.
    default = post.from_scores(box_problem(10), [None] * 10, score_fn, {}, seed=2)
    assert default.ess > max(sparse.ess, post.MIN_ESS)


@pytest.mark.unit
def test_draws_are_distinct_and_deterministic_from_their_seed(gaussian):
    first, again, other = gaussian.sample(500, seed=3), gaussian.sample(500, seed=3), gaussian.sample(500, seed=4)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.unique(first, dim=0).shape[0] == 500 and gaussian.sampling["distinct_fraction"] == 1.0
    assert bool((first.abs() <= BOX).all())
    info = gaussian.sampling
    assert info["draws"] == 500 and 0.05 < info["acceptance"] <= 1 and info["evaluations"] >= 500


@pytest.mark.unit
def test_a_proposal_resample_warns_only_when_its_draws_repeat_beyond_the_distinct_share(gaussian):
    # Budget fallbacks: 950 of 1,000 distinct is as good as independent; 800 of 1,000 is warned of.
    fresh = gaussian_reference(1000, seed=9)
    for distinct, warned in ((950, False), (800, True)):
        draws = torch.cat([fresh[:distinct], fresh[: 1000 - distinct]])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gaussian._sampled(draws, {"method": "resampled-proposal", "acceptance": 0.01, "evaluations": 25_000})
        assert gaussian.sampling["distinct_fraction"] == distinct / 1000
        assert bool(caught) is warned and (gaussian.sampling["warning"] is not None) is warned


# ---------------------------------------------------------------- four modes in five parameters

NOISE = 0.5
HALF = 3.0  # the box of the four-mode problem, in prior sds: the references truncate exactly too
# x0..x2 see θ0..θ2 through a mixing matrix; x3 and x4 see only θ3² and θ4², so ±θ3, ±θ4 fit alike.
MIXING = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, -0.5], [0.3, 0.0, 1.0]], dtype=torch.float64)
X5 = torch.tensor([0.4, -0.6, 1.0, 1.44, 2.25], dtype=torch.float64)  # squares of ±1.2 and ±1.5


def four_mode_log_likelihood(theta):
    """log p(x | θ) of the five-parameter problem, up to a constant."""
    linear = theta[:, :3] @ MIXING.T
    squares = theta[:, 3:] ** 2
    return -0.5 * (((X5[:3] - linear) ** 2).sum(dim=1) + ((X5[3:] - squares) ** 2).sum(dim=1)) / NOISE**2


def four_mode_posterior():
    """The four-mode posterior on a 10,240-point adaptive design (the default profile's)."""
    score_fn = normal_prior_scores(four_mode_log_likelihood, half=HALF)
    return post.from_scores(box_problem(5, HALF), [None] * 5, score_fn, adaptive_settings(10240, 1024, 3), seed=1)


def four_mode_reference(n, seed):
    """Exact i.i.d. draws of the four-mode posterior.

    Likelihood and prior factor into the linear block (θ0..θ2) and each of θ3, θ4, so the
    posterior does too. The block is Gaussian: precision I + AᵀA/σ², drawn exactly and
    kept inside the box (rejection, which truncates exactly). θ3 and θ4 are symmetric about
    0: |θ| is drawn by rejection from the half-normal prior, accepted with probability
    exp(−(x − θ²)²/(2σ²)) ≤ 1 (exact rejection: the envelope is the prior itself), then
    given a fair random sign.
    """
    generator = torch.Generator().manual_seed(seed)
    precision = torch.eye(3, dtype=torch.float64) + MIXING.T @ MIXING / NOISE**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ MIXING.T @ X5[:3] / NOISE**2
    factor = torch.linalg.cholesky(covariance)
    block = torch.empty(0, 3, dtype=torch.float64)
    while block.shape[0] < n:
        fresh = mean + torch.randn(n, 3, dtype=torch.float64, generator=generator) @ factor.T
        block = torch.cat([block, fresh[(fresh.abs() <= HALF).all(dim=1)]])
    return torch.cat([block[:n]] + [symmetric_draws(x, n, generator)[:, None] for x in X5[3:].tolist()], dim=1)


def symmetric_draws(x, n, generator):
    """n exact draws of the density ∝ exp(−(x − t²)²/(2σ²) − t²/2) on [−HALF, HALF] (see four_mode_reference)."""
    kept = torch.empty(0, dtype=torch.float64)
    while kept.shape[0] < n:
        t = torch.randn(20 * n, dtype=torch.float64, generator=generator).abs()
        accept = torch.rand(20 * n, dtype=torch.float64, generator=generator) < torch.exp(
            -0.5 * ((x - t * t) / NOISE) ** 2
        )
        kept = torch.cat([kept, t[accept & (t <= HALF)]])
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return kept[:n] * sign


@pytest.fixture(scope="module")
def four_modes(one_thread):
    """The four-mode posterior, built once."""
    return four_mode_posterior()


@pytest.mark.unit
def test_the_sampler_matches_exact_draws_of_four_modes_where_resampling_does_not(four_modes):
    draws = four_modes.sample(DRAWS, seed=0)
    assert four_modes.sampling["method"] == "rejection" and four_modes.sampling["components"] >= 4
    reference = four_mode_reference(DRAWS, seed=5)
    score = c2st(draws, reference)
    assert score <= 0.55, score
    # Each mode holds a quarter of the mass: four standard errors of 2,000 draws is 0.039.
    quadrants = torch.bincount(((draws[:, 3] > 0) * 2 + (draws[:, 4] > 0)).long(), minlength=4) / DRAWS
    assert torch.all((quadrants - 0.25).abs() < 0.039), quadrants
    assert c2st(old_resampling(four_modes, DRAWS), reference) > score + 0.05


# ---------------------------------------------------------------- when independent draws cost too much


@pytest.mark.unit
def test_draws_that_would_exceed_the_budget_fall_back_with_a_warning_naming_the_setting(gaussian):
    # About four proposal draws per accepted one here (acceptance near 0.25): a budget of
    # one per draw asked runs out first.
    with pytest.warns(UserWarning, match="raise inference.candidates.candidate_count"):
        draws = gaussian.sample(DRAWS, seed=0, budget=1)
    info = gaussian.sampling
    assert draws.shape == (DRAWS, 10) and info["method"] == "resampled-proposal" and info["warning"]
    assert (
        info["acceptance"] < 1
        and info["evaluations"] <= 3 * sampler.PILOT + max(DRAWS, sampler.BUDGET_FLOOR) + sampler.CHUNK
    )
    # The fallback resamples fresh proposal draws, far more effective than the candidates.
    assert torch.unique(draws, dim=0).shape[0] > 0.5 * DRAWS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gaussian.sample(DRAWS, seed=0)  # the default budget suffices: no warning
    assert gaussian.sampling["warning"] is None


# ---------------------------------------------------------------- the classifier two-sample test


@pytest.mark.unit
def test_c2st_is_a_half_for_one_distribution_one_for_disjoint_ones_and_deterministic():
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1500, 5, dtype=torch.float64, generator=generator) for _ in range(2))
    same = c2st(a, b, seed=2)
    assert 0.44 <= same <= 0.56 and c2st(a, b, seed=2) == same
    assert c2st(a + 6.0, b) >= 0.99
    assert c2st(a + 0.5, b) > 0.6  # a shift of half an sd is seen


def lattice_posterior(steps, kind="adaptive"):
    """A posterior on [0, 10]^p with these lattice steps (None: a continuous axis), its mode near 4.3."""

    def score_fn(theta):
        ratio = -0.5 * (((theta - 4.3) / 0.5) ** 2).sum(dim=1)
        return {"ratio": ratio, "posterior": ratio}

    p = len(steps)
    problem = types.SimpleNamespace(
        names=[f"k{j}" for j in range(p)],
        low=torch.zeros(p, dtype=torch.float64),
        high=torch.full((p,), 10.0, dtype=torch.float64),
    )
    return post.from_scores(problem, steps, score_fn, adaptive_settings(4096, 512, 3), seed=1)


@pytest.mark.unit
def test_an_enumerated_lattice_draws_exactly_from_its_masses_without_a_warning():
    lattice = lattice_posterior([0.2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its draws repeat by nature
        draws = lattice.sample(4000, seed=0)
    assert lattice.enumerated and lattice.sampling["method"] == "lattice" and lattice.sampling["acceptance"] is None
    frequency = (draws[:, None, 0] == lattice.points[None, :, 0]).double().mean(dim=0)
    assert torch.allclose(frequency, lattice.masses, atol=4 * math.sqrt(0.25 / 4000))


@pytest.mark.unit
def test_a_design_with_a_lattice_axis_resamples_and_warns_beyond_its_effective_candidates():
    mixed = lattice_posterior([0.2, None])
    assert not mixed.enumerated and 100 < mixed.ess < 4000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed.sample(int(mixed.ess), seed=0)
    with pytest.warns(UserWarning, match="candidate_count"):
        mixed.sample(4000, seed=0)
    assert mixed.sampling["method"] == "resampled" and mixed.sampling["distinct_fraction"] < 1


# ---------------------------------------------------------------- a narrow, correlated posterior in ten parameters

# x = A θ + N(0, NARROW_NOISE²), θ under a correlated normal prior (unit sds, correlation 0.8^|i − j|) cut
# to ±5 prior sds: the posterior's sds are 2.5-5% of the box, its correlations up to 0.68. The default
# design (40,960 adaptive candidates) leaves 1.2 to 17 of them effective at any candidate_count.
NARROW_NOISE = 0.3


def narrow_model():
    """The prior's covariance and the mixing matrix A of the narrow problem (seeded, fixed)."""
    index = torch.arange(10)
    covariance = 0.8 ** (index[:, None] - index[None]).abs().double()
    noise = torch.randn(10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(36))
    return covariance, torch.eye(10, dtype=torch.float64) + 0.8 * noise / math.sqrt(10)


def narrow_observation(seed):
    """A truth drawn from the cut prior (by rejection) and its observation x (10,)."""
    covariance, mixing = narrow_model()
    generator = torch.Generator().manual_seed(seed)
    truth = torch.full((10,), math.inf, dtype=torch.float64)
    while not bool((truth.abs() <= BOX).all()):
        truth = torch.linalg.cholesky(covariance) @ torch.randn(10, dtype=torch.float64, generator=generator)
    return mixing @ truth + NARROW_NOISE * torch.randn(10, dtype=torch.float64, generator=generator)


def narrow_scores(x):
    """The analysis' targets for observation x: the exact log-likelihood, and with the cut prior the log
    posterior (−inf outside the box)."""
    covariance, mixing = narrow_model()
    precision = torch.linalg.inv(covariance)

    def score_fn(theta):
        ratio = -0.5 * ((x - theta @ mixing.T) ** 2).sum(dim=1) / NARROW_NOISE**2
        prior = torch.where(
            (theta.abs() <= BOX).all(dim=1),
            -0.5 * ((theta @ precision) * theta).sum(dim=1),
            torch.tensor(-math.inf, dtype=torch.float64),
        )
        return {"ratio": ratio, "posterior": ratio + prior}

    return score_fn


def narrow_posterior(x, analysis=None):
    """The narrow problem's posterior for x on a design: {} is every inference key at its default."""
    return post.from_scores(
        box_problem(10), [None] * 10, narrow_scores(x), {} if analysis is None else analysis, seed=1
    )


def narrow_reference(x, n, seed):
    """n exact draws: the conjugate Gaussian posterior of the uncut prior, cut to the box by rejection (which
    draws the cut posterior exactly: the cut prior's posterior is the uncut one's, cut)."""
    covariance, mixing = narrow_model()
    posterior_covariance = torch.linalg.inv(torch.linalg.inv(covariance) + mixing.T @ mixing / NARROW_NOISE**2)
    mean = posterior_covariance @ mixing.T @ x / NARROW_NOISE**2
    factor, generator = torch.linalg.cholesky(posterior_covariance), torch.Generator().manual_seed(seed)
    kept = torch.empty(0, 10, dtype=torch.float64)
    while kept.shape[0] < n:
        fresh = mean + torch.randn(n, 10, dtype=torch.float64, generator=generator) @ factor.T
        kept = torch.cat([kept, fresh[(fresh.abs() <= BOX).all(dim=1)]])
    return kept[:n]


@pytest.mark.unit
def test_a_narrow_correlated_posterior_the_candidates_miss_is_found_by_population_monte_carlo():
    x = narrow_observation(0)
    narrow = narrow_posterior(x)
    assert narrow.ess < sampler.MIN_FIT_ESS  # the design alone: refused before population Monte Carlo
    draws = narrow.sample(DRAWS, seed=0)
    info = narrow.sampling
    assert info["method"] == "rejection" and info["path"] == "population Monte Carlo" and info["warning"] is None
    assert bool((draws.abs() <= BOX).all()) and info["effective"] > DRAWS
    assert c2st(draws, narrow_reference(x, DRAWS, seed=5)) <= 0.55
    assert torch.equal(draws, narrow.sample(DRAWS, seed=0))  # reproducible from the seed


@pytest.mark.unit
def test_the_effective_count_does_not_fall_as_candidate_count_rises():
    # The candidates' own effective count wanders (8.8, 4.6, 16.9 here); the sampler's stays high.
    x, effective = narrow_observation(1), []
    for count in (2**15, 2**16, 2**17):
        narrow = narrow_posterior(x, adaptive_settings(count, 4096, 3))
        narrow.sample(DRAWS, seed=0)
        effective.append(narrow.sampling["effective"])
    assert min(effective) > DRAWS and min(effective) > 0.5 * max(effective), effective


@pytest.mark.launch
def test_ten_thousand_draws_of_narrow_correlated_posteriors_pass_the_c2st():
    # The check: C2ST of 10,000 draws against 10,000 exact draws, three observations.
    for seed in range(3):
        x = narrow_observation(seed)
        draws = narrow_posterior(x).sample(10_000, seed=seed)
        assert c2st(draws, narrow_reference(x, 10_000, seed=10 + seed)) <= 0.55, seed


@pytest.mark.unit
def test_a_narrow_posteriors_moments_and_hpd_bounds_come_from_draws_where_its_candidates_are_too_few():
    x = narrow_observation(2)
    narrow = narrow_posterior(x)
    assert narrow.ess < post.MIN_ESS
    exact = narrow_reference(x, 100_000, seed=7)
    sd = exact.std(0)
    # The candidates' weighted moments: a few effective points, a posterior sd or so off on some axis.
    candidates_mean = narrow.masses @ narrow.points
    assert ((candidates_mean - exact.mean(0)).abs() / sd).max() > 0.5
    summary = narrow.summary([0.95])
    assert summary["moments"] == f"{post.SUMMARY_DRAWS} draws"
    assert ((torch.tensor(summary["mean"]) - exact.mean(0)).abs() / sd).max() < 0.05
    assert ((torch.tensor(summary["sd"]) / sd - 1).abs()).max() < 0.05
    correlation = lambda c: c / torch.sqrt(torch.outer(c.diagonal(), c.diagonal()))  # noqa: E731
    assert (correlation(narrow.cov()) - correlation(torch.cov(exact.T))).abs().max() < 0.05
    # The 0.95 HPD region's per-axis bounds: the exact posterior's region is a Gaussian ellipsoid, whose
    # projections are mean ± sqrt(chi2_10(0.95)) sd = ± 4.28 sd; the draws' extremes inside it fall short.
    region = summary["hpd"]["0.95"]
    half_width = (torch.tensor(region["upper"]) - torch.tensor(region["lower"])) / 2
    assert (half_width / sd > 3.0).all() and (half_width / sd < 4.3).all(), half_width / sd
    assert region["mass"] == pytest.approx(0.95, abs=0.002)
    # A posterior whose candidates are effective enough keeps their moments.
    assert gaussian_posterior().summary()["moments"] == "candidates"


# Four modes of the narrow posterior's shape in ten parameters: its mean with θ8 = ±1.2 and θ9 = ±1.5, 8 to 10
# posterior sds apart, equal shares. On Sobol candidates few are effective, and the design sees what it sees.
def four_narrow_modes():
    """The four means (4, 10) and the shared covariance of the four-mode problem."""
    covariance, mixing = narrow_model()
    shared = torch.linalg.inv(torch.linalg.inv(covariance) + mixing.T @ mixing / NARROW_NOISE**2)
    means = (shared @ mixing.T @ narrow_observation(0) / NARROW_NOISE**2).expand(4, 10).clone()
    means[:, 8], means[:, 9] = torch.tensor([1.2, 1.2, -1.2, -1.2]), torch.tensor([1.5, -1.5, 1.5, -1.5])
    return means, shared


def four_narrow_scores():
    """The four-mode density's score function (an equal mixture, −inf outside the box)."""
    means, covariance = four_narrow_modes()
    modes = torch.distributions.MultivariateNormal(means, covariance_matrix=covariance.expand(4, 10, 10))

    def score_fn(theta):
        density = torch.logsumexp(modes.log_prob(theta[:, None]), dim=1)
        inside = (theta.abs() <= BOX).all(dim=1)
        value = torch.where(inside, density, torch.tensor(-math.inf, dtype=torch.float64))
        return {"ratio": value, "posterior": value}

    return score_fn


@pytest.mark.unit
def test_four_narrow_modes_in_ten_parameters_are_found_by_the_tempered_search():
    analysis = settings_analysis.make_settings("default")
    analysis["inference"]["candidates"].update(kind="sobol", candidate_count=4096)
    four = post.from_scores(box_problem(10), [None] * 10, four_narrow_scores(), analysis, seed=1)
    draws = four.sample(DRAWS, seed=0)
    assert four.sampling["path"] == "population Monte Carlo" and four.sampling["components"] >= 4
    means, covariance = four_narrow_modes()
    shares = torch.bincount(torch.cdist(draws, means).argmin(dim=1), minlength=4) / DRAWS
    assert torch.all((shares - 0.25).abs() < 0.039), shares  # four standard errors of 2,000 draws
    generator = torch.Generator().manual_seed(5)
    exact = (
        means[torch.randint(0, 4, (DRAWS,), generator=generator)]
        + torch.randn(DRAWS, 10, dtype=torch.float64, generator=generator) @ torch.linalg.cholesky(covariance).T
    )
    assert bool((exact.abs() <= BOX).all())  # the box cuts nothing here: exact as drawn
    assert c2st(draws, exact) <= 0.55
