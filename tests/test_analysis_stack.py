"""Tests for the analysis stack: designs.py, case_scores.py, hpd.py and analysis_metrics.py (truths,
candidates, scores, HLD summaries and metrics)."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

import analysis_metrics
import case_scores
import designs
import hpd
from helpers import GROUPING_ROUNDING

LEVELS = (0.68, 0.95)


def gaussian_log_likelihood(sigma):
    """Reference log p(x|θ) for x ~ N(θ, σ²) per coordinate, summed over coordinates."""

    def log_likelihood(x, theta):
        z = (x - theta) / sigma
        return (-0.5 * z * z - math.log(sigma) - 0.5 * math.log(2 * math.pi)).sum(dim=-1)

    return log_likelihood


def gaussian_simulator(sigma):
    """x ~ N(θ, σ²) per coordinate, drawn with the given generator."""

    def simulate(theta, generator):
        return theta + sigma * torch.randn(theta.shape, generator=generator, dtype=torch.float64)

    return simulate


def z_of(level):
    """Two-sided standard normal quantile for an enclosed mass."""
    return float(torch.special.ndtri(torch.tensor((1 + level) / 2, dtype=torch.float64)))


def exact_case_scores(truths, observations, points, log_measure, sigma):
    """Scores (N, K) and truth scores (N,) with the exact likelihood, one case at a time."""
    ll = gaussian_log_likelihood(sigma)
    scores = torch.stack([case_scores.exact_scores(ll, obs, points, chunk_rows=4096) for obs in observations])
    truth = torch.stack(
        [case_scores.exact_scores(ll, obs, t[None], chunk_rows=64)[0] for obs, t in zip(observations, truths)]
    )
    return scores, truth


# ---------------------------------------------------------------------------
# HLD against the analytic Gaussian
# ---------------------------------------------------------------------------


@pytest.mark.unit
def test_hld_matches_analytic_gaussian_interval():
    sigma, m = 1.0, 15
    low, high = torch.tensor([0.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64)
    points, log_measure = designs.make_candidates(
        low, high, [None], {"kind": "grid", "candidate_points_per_axis": 4001}, 0
    )
    assert points.shape == (4001, 1)
    truths = torch.tensor([[4.3]], dtype=torch.float64)
    obs = designs.make_observations(gaussian_simulator(sigma), truths, m, seed=3)
    scores, truth_scores = exact_case_scores(truths, obs, points, log_measure, sigma)
    s = hpd.hld_summaries(scores, log_measure, points, truth_scores, LEVELS)
    xbar = float(obs[0, :, 0].mean())
    h = 10.0 / 4000
    for i, level in enumerate(LEVELS):
        half = z_of(level) * sigma / math.sqrt(m)
        assert abs(s["lower"][0, i, 0] - (xbar - half)) <= 2 * h
        assert abs(s["upper"][0, i, 0] - (xbar + half)) <= 2 * h
        assert level <= s["mass"][0, i] < level + 0.01
    assert abs(s["mode"][0, 0] - xbar) <= h
    # Posterior N(x̄, σ²/m) on a grid: ESS ≈ 2·sqrt(π)·sd / h.
    expected_ess = 2 * math.sqrt(math.pi) * sigma / math.sqrt(m) / h
    assert abs(s["ess"][0] / expected_ess - 1) < 0.02
    # Normaliser: ∫ Π N(x_k; θ, σ²) dθ = Π N(x_k; x̄, σ²) · sqrt(2π σ²/m).
    x = obs[0, :, 0]
    exact = float(gaussian_log_likelihood(sigma)(x[:, None], torch.tensor([xbar])).sum()) + 0.5 * math.log(
        2 * math.pi * sigma**2 / m
    )
    assert abs(s["log_normalizer"][0] - exact) < 1e-4


@pytest.mark.unit
def test_coverage_is_nominal_in_one_dimension():
    sigma, m = 1.0, 5
    low, high = torch.tensor([0.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64)
    truths = designs.make_truths(
        low,
        high,
        torch.tensor([0.2]),
        {"kind": "sobol", "sobol_truths": 1024, "truth_margin_fraction": 0.2, "align_truths_to_grid": False},
        seed=1,
    )
    assert truths.shape == (1024, 1)
    obs = designs.make_observations(gaussian_simulator(sigma), truths, m, seed=2)
    points, log_measure = designs.make_candidates(
        low, high, [None], {"kind": "grid", "candidate_points_per_axis": 801}, 0
    )
    scores, truth_scores = exact_case_scores(truths, obs, points, log_measure, sigma)
    s = hpd.hld_summaries(scores, log_measure, points, truth_scores, LEVELS)
    cov = analysis_metrics.coverage_metrics(s, truths.numpy(), LEVELS, ["mean:0"])
    for level in LEVELS:
        se = math.sqrt(level * (1 - level) / truths.shape[0])
        entry = cov[analysis_metrics.level_key(level)]
        assert abs(entry["joint"] - level) < 4 * se
        assert abs(entry["per_axis"]["mean:0"] - level) < 4 * se


@pytest.mark.unit
def test_coverage_is_nominal_in_two_dimensions():
    sigma, m = 2.0, 4
    low = torch.tensor([0.0, 0.0], dtype=torch.float64)
    high = torch.tensor([10.0, 10.0], dtype=torch.float64)
    truths = designs.make_truths(
        low,
        high,
        None,
        {"kind": "sobol", "sobol_truths": 512, "truth_margin_fraction": 0.3, "align_truths_to_grid": False},
        seed=5,
    )
    assert truths.shape == (1024, 2)
    obs = designs.make_observations(gaussian_simulator(sigma), truths, m, seed=6)
    points, log_measure = designs.make_candidates(
        low, high, [None, None], {"kind": "grid", "candidate_points_per_axis": 41}, 0
    )
    scores, truth_scores = exact_case_scores(truths, obs, points, log_measure, sigma)
    s = hpd.hld_summaries(scores, log_measure, points, truth_scores, LEVELS)
    cov = analysis_metrics.coverage_metrics(s, truths.numpy(), LEVELS, ["mean:0", "mean:1"])
    for level in LEVELS:
        se = math.sqrt(level * (1 - level) / truths.shape[0])
        assert abs(cov[analysis_metrics.level_key(level)]["joint"] - level) < 4 * se
        # Projected bounds of a joint region are conservative per axis.
        assert cov[analysis_metrics.level_key(level)]["mean"] >= level - 4 * se


# ---------------------------------------------------------------------------
# HLD rules: ties, density ranking, errors, stability
# ---------------------------------------------------------------------------


@pytest.mark.unit
def test_ties_at_the_cutoff_are_all_included():
    points = torch.arange(5, dtype=torch.float64)[:, None]
    scores = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    s = hpd.hld_summaries(scores, torch.zeros(5), points, torch.tensor([0.0]), [0.5])
    e = math.e
    assert s["threshold"][0, 0] == 1.0
    assert s["lower"][0, 0, 0] == 1.0 and s["upper"][0, 0, 0] == 3.0
    assert s["mass"][0, 0] == pytest.approx(3 * e / (3 * e + 2))
    assert not s["covered"][0, 0]  # the truth score 0 is below the threshold 1


@pytest.mark.unit
def test_ranking_follows_density_not_mass():
    points = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    scores = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    # Candidate 0 has the highest density but a tiny weight; ranked by mass, 1 would come first.
    log_measure = torch.tensor([math.log(0.01), 0.0, 0.0], dtype=torch.float64)
    s = hpd.hld_summaries(scores, log_measure, points, torch.tensor([1.0]), [0.01, 0.5])
    q = np.array([0.01 * math.e**2, math.e, 1.0])
    q /= q.sum()
    assert s["mode"][0, 0] == 0.0
    assert s["lower"][0, 0, 0] == 0.0 and s["upper"][0, 0, 0] == 0.0
    assert s["mass"][0, 0] == pytest.approx(q[0])
    assert s["lower"][0, 1, 0] == 0.0 and s["upper"][0, 1, 0] == 1.0
    assert s["threshold"][0, 1] == 1.0 and s["covered"][0, 1] and not s["covered"][0, 0]
    assert s["ess"][0] == pytest.approx(1 / (q**2).sum())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.unit
def test_nan_or_plus_inf_scores_raise_naming_the_case(value):
    scores = torch.zeros(4, 3, dtype=torch.float64)
    scores[2, 1] = value
    with pytest.raises(ValueError, match="case 2"):
        hpd.hld_summaries(scores, torch.zeros(3), torch.zeros(3, 1), torch.zeros(4), LEVELS)


@pytest.mark.unit
def test_all_minus_inf_scores_raise_and_some_minus_inf_are_fine():
    scores = torch.zeros(3, 4, dtype=torch.float64)
    scores[0, :2] = -math.inf
    points = torch.arange(4, dtype=torch.float64)[:, None]
    s = hpd.hld_summaries(scores, torch.zeros(4), points, torch.zeros(3), [1.0])
    assert s["lower"][0, 0, 0] == 2.0 and s["mass"][0, 0] == pytest.approx(1.0)
    scores[1] = -math.inf
    with pytest.raises(ValueError, match="case 1"):
        hpd.hld_summaries(scores, torch.zeros(4), points, torch.zeros(3), LEVELS)


@pytest.mark.unit
def test_huge_score_offsets_are_stable():
    torch.manual_seed(0)
    points = torch.linspace(0, 1, 50, dtype=torch.float64)[:, None]
    log_measure = torch.full((50,), math.log(1 / 50), dtype=torch.float64)
    base = -((points[:, 0][None] - torch.tensor([[0.3], [0.6]])) ** 2) * 40
    truth = torch.tensor([-0.5, -2.0], dtype=torch.float64)
    offsets = torch.tensor([[1e6], [-1e6]], dtype=torch.float64)
    a = hpd.hld_summaries(base, log_measure, points, truth, LEVELS)
    b = hpd.hld_summaries(base + offsets, log_measure, points, truth + offsets[:, 0], LEVELS)
    for key in ("lower", "upper", "covered", "mode"):
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_allclose(b["mass"], a["mass"], rtol=1e-9)
    np.testing.assert_allclose(b["ess"], a["ess"], rtol=1e-6)
    np.testing.assert_allclose(b["log_normalizer"] - offsets[:, 0].numpy(), a["log_normalizer"], atol=1e-6)
    assert np.isfinite(b["ess"]).all()


@hsettings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(1, 60),
    tied=st.booleans(),
    levels=st.lists(st.sampled_from([0.1, 0.5, 0.68, 0.95, 1.0]), min_size=1, max_size=4),
)
@pytest.mark.property
def test_summary_bounds_are_those_of_each_region(seed, count, tied, levels):
    """Every level's bounds are the extremes of its region {score >= threshold}, ties and repeated
    or unordered levels included."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, count, generator=gen, dtype=torch.float64)
    if tied:  # few distinct densities, some points of none
        scores = torch.floor(scores * 2).masked_fill(scores > 1.5, -math.inf)
        scores[:, 0] = 0.0
    points = torch.rand(count, 2, generator=gen, dtype=torch.float64)
    s = hpd.hld_summaries(scores, torch.zeros(count), points, torch.zeros(3), levels)
    for case in range(3):
        for level in range(len(levels)):
            inside = points[scores[case] >= s["threshold"][case, level]].numpy()
            np.testing.assert_array_equal(s["lower"][case, level], inside.min(0))
            np.testing.assert_array_equal(s["upper"][case, level], inside.max(0))


@hsettings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(1, 40), levels=st.integers(1, 4), non_finite=st.booleans())
@pytest.mark.property
def test_region_bounds_with_any_thresholds(seed, count, levels, non_finite):
    """region_bounds on thresholds of any order (as the probes meet them): each level's bounds
    are the extremes of the points scoring at least its threshold, ±inf where none does; a NaN
    score reaches no threshold."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.floor(torch.randn(2, count, generator=gen, dtype=torch.float64) * 2)
    if non_finite:
        scores[:, ::3] = math.nan
        scores[:, 1::4] = -math.inf
    threshold = torch.floor(torch.randn(2, levels, generator=gen, dtype=torch.float64) * 3)
    columns = torch.rand(2, 3, count, generator=gen, dtype=torch.float64)
    lower, upper = hpd.region_bounds(columns, scores, threshold)
    inside = (scores[:, None, :] >= threshold[:, :, None])[:, :, None, :]  # (B, L, 1, K)
    expected_lower = torch.where(inside, columns[:, None], math.inf).amin(dim=3)
    expected_upper = torch.where(inside, columns[:, None], -math.inf).amax(dim=3)
    assert torch.equal(lower, expected_lower) and torch.equal(upper, expected_upper)


@pytest.mark.unit
def test_summaries_are_vectorised_consistently():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(6, 30, generator=gen, dtype=torch.float64)
    points = torch.rand(30, 2, generator=gen, dtype=torch.float64)
    log_measure = torch.rand(30, generator=gen, dtype=torch.float64).log()
    truth = torch.randn(6, generator=gen, dtype=torch.float64)
    together = hpd.hld_summaries(scores, log_measure, points, truth, LEVELS)
    for i in range(6):
        alone = hpd.hld_summaries(scores[i : i + 1], log_measure, points, truth[i : i + 1], LEVELS)
        for key in together:
            np.testing.assert_array_equal(together[key][i], alone[key][0])
    assert together["lower"].shape == (6, 2, 2) and together["covered"].dtype == bool


# ---------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------


def small_network(d, p):
    """A tiny real MLP logit network."""
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(d + p, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )


@pytest.mark.unit
def test_ensemble_scores_do_not_depend_on_chunk_rows():
    d, p, m, K = 2, 2, 15, 700  # K·m = 10500 > EVAL_BLOCK_ROWS, so several fixed blocks
    net = small_network(d, p)
    seen = []

    def logit_fn(rows):
        seen.append(rows.shape[0])
        assert rows.dtype == torch.float32 and not torch.is_grad_enabled()
        return net(rows).squeeze(-1)

    gen = torch.Generator().manual_seed(1)
    obs = torch.randn(m, d, generator=gen)
    points = torch.rand(K, p, generator=gen, dtype=torch.float64) * 10
    reference = case_scores.ensemble_scores(logit_fn, obs, points, 10**7)
    assert reference.dtype == torch.float64 and reference.shape == (K,)
    with torch.no_grad():
        rows = torch.cat([obs.repeat(K, 1), points.float().repeat_interleave(m, 0)], dim=1)
        direct = net(rows).reshape(K, m).double().sum(1)
    torch.testing.assert_close(reference, direct, rtol=1e-5, atol=1e-5)
    by_policy = case_scores.ensemble_scores(logit_fn, obs, points, case_scores.EVAL_BLOCK_ROWS)
    for chunk in (case_scores.EVAL_BLOCK_ROWS, 20000, 10**6):
        # On the CPU every chunk_rows from EVAL_BLOCK_ROWS up gives calls of that many rows: bitwise the same.
        rows_per_call = case_scores.call_policy("cpu", chunk).rows_per_call
        assert torch.equal(case_scores.ensemble_scores(logit_fn, obs, points, rows_per_call), by_policy)
        # Calls of other sizes: the same to float32 rounding.
        torch.testing.assert_close(
            case_scores.ensemble_scores(logit_fn, obs, points, chunk), reference, **GROUPING_ROUNDING
        )
    few = points[:50]  # small chunks mean many calls: keep them cheap
    few_reference = case_scores.ensemble_scores(logit_fn, obs, few, 10**7)
    # Fewer candidates make calls of other shapes, whose BLAS kernels may round otherwise.
    torch.testing.assert_close(few_reference, reference[:50], **GROUPING_ROUNDING)
    for chunk in (1, 7, 15, 16, 100, 301, 4099):
        seen.clear()
        scores = case_scores.ensemble_scores(logit_fn, obs, few, chunk)
        torch.testing.assert_close(scores, few_reference, **GROUPING_ROUNDING)
        cap = max(chunk // m * m, m)
        assert max(seen) < cap + case_scores.ROW_PAD


@pytest.mark.unit
def test_ensemble_scores_do_not_depend_on_how_many_calls_are_built_together(monkeypatch):
    """Calls built one at a time, three at a time or all at once, cases together or alone: bitwise the same
    scores (the same call shapes); rows column by column or contiguous: the same to float32 rounding (a
    BLAS kernel may round a transposed operand otherwise, as MKL's AVX2 one does on two threads)."""
    # 4 cases of 1200 candidates, 15 observations: each case takes three calls of 400 candidates
    # (6,000 rows, padded to 6,016), none shared with another case.
    d, p, m, cases, n = 2, 3, 15, 4, 1200
    net = small_network(d, p)
    gen = torch.Generator().manual_seed(5)
    obs = torch.randn(cases, m, d, generator=gen)
    points = torch.rand(cases, n, p, generator=gen, dtype=torch.float64) * 10
    counted = case_scores.Evaluations()
    reference = case_scores.ensemble_scores(
        lambda rows: net(rows).squeeze(-1), obs, points, case_scores.EVAL_BLOCK_ROWS, counted
    )
    assert counted.calls == 12 and counted.rows == cases * n * m and counted.call_rows == 12 * 6016
    with torch.no_grad():
        rows = torch.cat([obs[:, None].expand(-1, n, -1, -1), points.float()[:, :, None].expand(-1, -1, m, -1)], 3)
        direct = net(rows.reshape(-1, d + p)).reshape(cases, n, m).double().sum(2)
    torch.testing.assert_close(reference, direct, rtol=1e-5, atol=1e-5)
    width = case_scores.EVAL_BLOCK_ROWS * (d + p) * 4
    for group_bytes in (1, 3 * width, 4 * width, 7 * width, 1 << 30):
        monkeypatch.setattr(case_scores, "CALL_GROUP_BYTES", group_bytes)
        for column_rows in (True, False):
            scores = case_scores.ensemble_scores(
                lambda rows: net(rows).squeeze(-1), obs, points, case_scores.EVAL_BLOCK_ROWS, column_rows=column_rows
            )
            if column_rows:
                assert torch.equal(scores, reference)
            else:
                torch.testing.assert_close(scores, reference, **GROUPING_ROUNDING)
        for case in range(cases):
            alone = case_scores.ensemble_scores(
                lambda rows: net(rows).squeeze(-1), obs[case], points[case], case_scores.EVAL_BLOCK_ROWS
            )
            assert torch.equal(alone, reference[case])


@hsettings(max_examples=80, deadline=None)
@given(cases=st.integers(1, 7), n=st.integers(1, 40), rows_per_call=st.integers(1, 400))
@pytest.mark.property
def test_each_call_holds_one_case_or_whole_cases_with_their_observations_beside(cases, n, rows_per_call):
    d, m = 2, 3
    x = torch.randn(cases, m, d, generator=torch.Generator().manual_seed(cases * n))
    beside = x.permute(0, 2, 1)[..., None]
    block, span, together = case_scores._call_layout(m, cases, n, rows_per_call)
    assert block * m <= max(rows_per_call, m) and span >= n
    found = torch.zeros(cases, n, dtype=torch.long)  # how often each candidate sits in a call
    for start in range(0, cases * span, block):
        observed = torch.full((d, m, block), math.nan)
        case_scores._fill_observations(observed, beside, start // span, together)
        slots = torch.arange(start, start + block)
        case, position = slots // span, slots % span
        real = (case < cases) & (position < n)
        assert len(set(case[real].tolist())) <= max(together, 1)  # one case, or whole cases together
        expected = x[case[real]].permute(2, 1, 0)  # each candidate's case's, (d, m, candidates)
        assert torch.equal(observed[:, :, real], expected)
        found[case[real], position[real]] += 1
    assert bool((found == 1).all())


@pytest.mark.unit
def test_a_network_giving_more_than_one_logit_per_row_is_refused():
    net = small_network(2, 2)
    gen = torch.Generator().manual_seed(8)
    obs, points = torch.randn(15, 2, generator=gen), torch.rand(40, 2, generator=gen, dtype=torch.float64)
    with pytest.raises(ValueError, match="one logit per row"):
        case_scores.ensemble_scores(lambda rows: net(rows).expand(-1, 2), obs, points, case_scores.EVAL_BLOCK_ROWS)
    column = case_scores.ensemble_scores(
        lambda rows: net(rows), obs, points, case_scores.EVAL_BLOCK_ROWS
    )  # (rows, 1) is one
    assert torch.equal(
        column,
        case_scores.ensemble_scores(lambda rows: net(rows).squeeze(-1), obs, points, case_scores.EVAL_BLOCK_ROWS),
    )


@pytest.mark.unit
def test_a_network_that_needs_contiguous_rows_is_given_them():
    d, p, m = 2, 2, 15
    net = small_network(d, p)

    def flattening(rows):  # view(-1) needs contiguous rows
        return net(rows.view(-1).view(-1, d + p)).squeeze(-1)

    def plain(rows):
        return net(rows).squeeze(-1)

    assert case_scores.accepts_column_rows(plain, d + p, torch.device("cpu"))
    assert not case_scores.accepts_column_rows(flattening, d + p, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="view"):
        flattening(torch.zeros(d + p, 64).T)
    gen = torch.Generator().manual_seed(6)
    obs = torch.randn(m, d, generator=gen)
    points = torch.rand(700, p, generator=gen, dtype=torch.float64) * 10
    # Contiguous rows against column rows: the same to float32 rounding (see the test above).
    torch.testing.assert_close(
        case_scores.ensemble_scores(flattening, obs, points, case_scores.EVAL_BLOCK_ROWS, column_rows=False),
        case_scores.ensemble_scores(plain, obs, points, case_scores.EVAL_BLOCK_ROWS),
        **GROUPING_ROUNDING,
    )


@pytest.mark.unit
def test_exact_scores_do_not_depend_on_chunk_rows():
    sigma = 1.5
    gen = torch.Generator().manual_seed(2)
    obs = torch.randn(9, 3, generator=gen, dtype=torch.float64) + 4
    points = torch.rand(257, 3, generator=gen, dtype=torch.float64) * 8
    ll = gaussian_log_likelihood(sigma)
    reference = case_scores.exact_scores(ll, obs, points, chunk_rows=10**6)
    z = (obs[None] - points[:, None]) / sigma
    direct = (-0.5 * z**2 - math.log(sigma) - 0.5 * math.log(2 * math.pi)).sum(dim=(1, 2))
    torch.testing.assert_close(reference, direct, rtol=1e-12, atol=1e-9)
    for chunk in (1, 8, 9, 10, 100, 2000):
        assert torch.equal(case_scores.exact_scores(ll, obs, points, chunk_rows=chunk), reference)


# ---------------------------------------------------------------------------
# Truths and observations
# ---------------------------------------------------------------------------

BOX2 = (torch.tensor([0.0, 0.2], dtype=torch.float64), torch.tensor([10.0, 4.0], dtype=torch.float64))
STEP2 = torch.tensor([0.2, 0.2], dtype=torch.float64)


@pytest.mark.unit
def test_grid_truths_count_margin_and_order():
    settings = {"kind": "grid", "truth_points_per_axis": 7, "truth_margin_fraction": 0.1, "align_truths_to_grid": False}
    truths = designs.make_truths(*BOX2, STEP2, settings, seed=0)
    assert truths.shape == (49, 2) and truths.dtype == torch.float64
    assert designs.truth_count(2, settings) == 49
    torch.testing.assert_close(truths.min(0).values, torch.tensor([1.0, 0.58], dtype=torch.float64))
    torch.testing.assert_close(truths.max(0).values, torch.tensor([9.0, 3.62], dtype=torch.float64))
    assert torch.equal(truths[:7, 0], torch.full((7,), 1.0, dtype=torch.float64))  # first axis slowest


@pytest.mark.unit
def test_sobol_and_size_adaptive_truths():
    settings = {"kind": "sobol", "sobol_truths": 16, "truth_margin_fraction": 0.25, "align_truths_to_grid": False}
    truths = designs.make_truths(*BOX2, STEP2, settings, seed=3)
    assert truths.shape == (32, 2) == (designs.truth_count(2, settings), 2)
    assert (truths[:, 0] >= 2.5).all() and (truths[:, 0] <= 7.5).all()
    assert (truths[:, 1] >= 1.15).all() and (truths[:, 1] <= 3.05).all()
    assert torch.equal(truths, designs.make_truths(*BOX2, STEP2, settings, seed=3))
    assert not torch.equal(truths, designs.make_truths(*BOX2, STEP2, settings, seed=4))
    adaptive = {
        "kind": "size_adaptive",
        "truth_points_per_axis": 7,
        "sobol_truths": 16,
        "max_grid_truths": 49,
        "align_truths_to_grid": False,
    }
    assert designs.make_truths(*BOX2, STEP2, adaptive, seed=0).shape == (49, 2)
    adaptive["max_grid_truths"] = 48
    assert designs.make_truths(*BOX2, STEP2, adaptive, seed=0).shape == (32, 2)
    assert designs.truth_count(2, adaptive) == 32


@pytest.mark.unit
def test_truths_snap_to_lattice_and_repeat():
    low, high = torch.tensor([0.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64)
    settings = {
        "kind": "grid",
        "truth_points_per_axis": 100,
        "truth_margin_fraction": 0.1,
        "align_truths_to_grid": True,
        "repeats": 1,
    }
    truths = designs.make_truths(low, high, torch.tensor([0.2], dtype=torch.float64), settings, seed=0)
    lattice = designs.lattice_support(0.0, 10.0, 0.2)
    assert truths.shape == (100, 1)  # every truth stays a case, even where two snap together
    assert torch.equal(torch.unique(truths[:, 0]), lattice[5:46])  # bitwise the candidate lattice
    assert torch.all(torch.diff(truths[:, 0]) >= 0)  # order kept
    settings["repeats"] = 3
    repeated = designs.make_truths(low, high, torch.tensor([0.2], dtype=torch.float64), settings, seed=0)
    assert torch.equal(repeated, truths.repeat_interleave(3, 0))
    assert designs.truth_count(1, settings) == 300 == repeated.shape[0]
    # Snapping clamps into the box: the lattice on [0, 1] by 0.3 ends at 0.9.
    snapped = designs.snap_to_lattice(torch.tensor([[0.99], [0.44], [-0.1]], dtype=torch.float64), [0.0], [1.0], [0.3])
    torch.testing.assert_close(snapped[:, 0], torch.tensor([0.9, 0.3, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.unit
def test_observations_are_ensembles_per_truth_and_deterministic():
    truths = torch.tensor([[1.0, 2.0], [5.0, 9.0], [3.0, 3.0]], dtype=torch.float64)
    simulate = gaussian_simulator(0.1)
    obs = designs.make_observations(simulate, truths, 200, seed=7)
    assert obs.shape == (3, 200, 2)
    torch.testing.assert_close(obs.mean(1), truths, atol=0.05, rtol=0)
    assert torch.equal(obs, designs.make_observations(simulate, truths, 200, seed=7))
    assert not torch.equal(obs, designs.make_observations(simulate, truths, 200, seed=8))
    assert not torch.equal(obs[0, 0], obs[0, 1])  # independent draws within an ensemble


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


@pytest.mark.unit
def test_sobol_candidates_have_weights_summing_to_volume():
    settings = {"kind": "sobol", "candidate_count": 256}
    points, log_measure = designs.make_candidates(*BOX2, [None, None], settings, seed=1)
    assert points.shape == (256, 2) and designs.candidate_count_for(2, [None, None], *BOX2, settings) == 256
    assert float(log_measure.exp().sum()) == pytest.approx(10.0 * 3.8, rel=1e-12)
    assert torch.allclose(log_measure, log_measure[0].expand(256))
    assert (points >= BOX2[0]).all() and (points <= BOX2[1]).all()


@pytest.mark.unit
def test_grid_candidates_integrate_a_known_function():
    settings = {"kind": "grid", "candidate_points_per_axis": 64}
    points, log_measure = designs.make_candidates(*BOX2, [None, None], settings, seed=0)
    assert points.shape == (64 * 64, 2) == (designs.candidate_count_for(2, [None, None], *BOX2, settings), 2)
    w = log_measure.exp()
    assert float((w * (points[:, 0] + 3 * points[:, 1])).sum()) == pytest.approx(
        3.8 * 50 + 10 * 1.5 * (16 - 0.04), rel=1e-12
    )  # linear: trapezoid is exact
    integral = float((w * torch.exp(-points[:, 0] / 5) * points[:, 1] ** 2).sum())
    exact = 5 * (1 - math.exp(-2)) * (4**3 - 0.2**3) / 3
    assert integral == pytest.approx(exact, rel=1e-3)


@pytest.mark.unit
def test_lattice_coordinates_use_counting_measure():
    steps = [0.2, None]
    grid = {"kind": "grid", "candidate_points_per_axis": 8}
    points, log_measure = designs.make_candidates(*BOX2, steps, grid, seed=0)
    assert points.shape == (51 * 8, 2) and designs.candidate_count_for(2, steps, *BOX2, grid) == 408
    assert float(log_measure.exp().sum()) == pytest.approx(51 * 3.8)
    lattice = designs.lattice_support(0.0, 10.0, 0.2)
    assert torch.isin(points[:, 0], lattice).all()
    sobol = {"kind": "sobol", "candidate_count": 512}
    points, log_measure = designs.make_candidates(*BOX2, steps, sobol, seed=2)
    assert torch.isin(points[:, 0], lattice).all()
    assert float(log_measure.exp().sum()) == pytest.approx(51 * 3.8)
    assert len(set(points[:, 0].tolist())) > 40  # lattice indices spread over the support
    continuous = dict(sobol, native_grid_prior=False)
    points, _ = designs.make_candidates(*BOX2, steps, continuous, seed=2)
    assert not torch.isin(points[:, 0], lattice).all()


@pytest.mark.unit
def test_all_lattice_prior_is_enumerated_or_merged():
    steps = [0.2, 0.2]
    settings = {"kind": "sobol", "candidate_count": 256, "max_enumerated": 200000}
    points, log_measure = designs.make_candidates(*BOX2, steps, settings, seed=0)
    assert points.shape == (51 * 20, 2) == (designs.candidate_count_for(2, steps, *BOX2, settings), 2)
    assert torch.equal(log_measure, torch.zeros(51 * 20, dtype=torch.float64))
    assert len({tuple(r) for r in points.tolist()}) == 51 * 20
    # Too many to enumerate: Sobol draws with duplicates merged, total weight = lattice size.
    settings = {"kind": "sobol", "candidate_count": 4096, "max_enumerated": 100}
    points, log_measure = designs.make_candidates(*BOX2, steps, settings, seed=0)
    assert points.shape[0] < 4096 and len({tuple(r) for r in points.tolist()}) == points.shape[0]
    assert float(log_measure.exp().sum()) == pytest.approx(51 * 20, rel=1e-12)


@pytest.mark.unit
def test_duplicate_points_are_merged_with_summed_weights():
    points = torch.tensor([[1.0, 2.0], [0.0, 0.0], [1.0, 2.0], [3.0, 1.0], [0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    log_measure = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float64).log()
    merged, merged_log = designs.merge_duplicates(points, log_measure)
    assert merged.tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]]
    torch.testing.assert_close(merged_log.exp(), torch.tensor([1.0, 0.7, 0.4], dtype=torch.float64))


@pytest.mark.unit
def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="candidates kind"):
        designs.make_candidates(*BOX2, [None, None], {"kind": "halton"}, seed=0)
    with pytest.raises(ValueError, match="truths kind"):
        designs.make_truths(*BOX2, STEP2, {"kind": "random"}, seed=0)
    with pytest.raises(ValueError, match="low < high"):
        designs.make_candidates(torch.tensor([1.0]), torch.tensor([1.0]), [None], {"kind": "sobol"}, seed=0)
    with pytest.raises(ValueError, match="grid_step"):
        designs.make_truths(*BOX2, None, {"kind": "grid", "align_truths_to_grid": True}, seed=0)
    with pytest.raises(ValueError, match="levels"):
        hpd.hld_summaries(torch.zeros(1, 2), torch.zeros(2), torch.zeros(2, 1), torch.zeros(1), [0.0])


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def hand_summaries():
    """Two cases, one level, two axes, with easy numbers."""
    return {
        "lower": np.array([[[0.0, 1.0]], [[2.0, 2.0]]]),
        "upper": np.array([[[1.0, 3.0]], [[4.0, 2.5]]]),
        "covered": np.array([[True], [False]]),
        "mass": np.array([[0.70], [0.80]]),
        "ess": np.array([4.0, 100.0]),
    }


@pytest.mark.unit
def test_bias_metrics_by_hand():
    out = analysis_metrics.bias_metrics(
        np.array([[1.0, 2.0], [3.0, 2.0]]), np.array([[0.0, 2.0], [4.0, 0.0]]), ["a", "b"]
    )
    assert out["per_axis"]["a"] == {"signed": 0.0, "absolute": 1.0, "rmse": 1.0}
    assert out["per_axis"]["b"] == {"signed": 1.0, "absolute": 1.0, "rmse": pytest.approx(math.sqrt(2))}
    assert out["rmse"] == pytest.approx(math.sqrt(6 / 4))
    empty = analysis_metrics.bias_metrics(np.zeros((0, 1)), np.zeros((0, 1)), ["a"])
    assert empty["rmse"] is None and empty["per_axis"]["a"]["signed"] is None
    json.dumps(out), json.dumps(empty)


@pytest.mark.unit
def test_coverage_and_width_metrics_by_hand():
    s = hand_summaries()
    truths = np.array([[0.5, 4.0], [3.0, 2.5]])
    cov = analysis_metrics.coverage_metrics(s, truths, [0.7], ["a", "b"])
    entry = cov["0.7"]
    assert {k: entry[k] for k in ("nominal", "cases", "per_axis", "mean", "joint")} == {
        "nominal": 0.7,
        "cases": 2,
        "per_axis": {"a": 1.0, "b": 0.5},
        "mean": 0.75,
        "joint": 0.5,
    }
    z2 = 1.959963984540054**2
    # Wilson at 1 of 2 is symmetric about 1/2; at 2 of 2 its lower end is n / (n + z²).
    assert entry["interval"] == pytest.approx(
        [
            0.5 - 1.959963984540054 * math.sqrt(0.125 + z2 / 16) / (1 + z2 / 2),
            0.5 + 1.959963984540054 * math.sqrt(0.125 + z2 / 16) / (1 + z2 / 2),
        ]
    )
    assert entry["per_axis_interval"]["a"] == pytest.approx([2 / (2 + z2), 1.0])
    assert entry["per_axis_interval"]["b"] == pytest.approx(entry["interval"])
    width = analysis_metrics.width_metrics(s, [0.7], ["a", "b"])
    assert width == {"0.7": {"per_axis": {"a": 1.5, "b": 1.25}, "mean": 1.375}}
    json.dumps(cov), json.dumps(width)


@pytest.mark.unit
def test_resolution_metrics_by_hand():
    s = hand_summaries()
    s["region_ess"] = np.array([150.0, 300.0])
    out = analysis_metrics.resolution_metrics(s, 200, [0.7])
    assert out["candidate_count"] == 200 and out["ess_min"] == 4.0 and out["ess_median"] == 52.0
    assert out["ess_median_fraction"] == pytest.approx(0.26) and out["cases"] == 2
    assert out["region_ess_min"] == 150.0 and out["region_ess_median"] == 225.0
    assert out["attained_mass"] == {"0.7": pytest.approx(0.75)} and out["warning"] is None
    assert out["flagged"] == {"few_effective_points": 0, "edge_mass": 0, "disagreement": 0, "any": 0}
    s["mass"] = np.array([[0.9], [0.8]])
    s["ess"] = np.array([3.0, 5.0])
    out = analysis_metrics.resolution_metrics(s, 200, [0.7])
    assert "median ESS" in out["warning"] and "exceeds level 0.7" in out["warning"]
    assert "kind to 'adaptive'" in out["warning"]
    json.dumps(out)


@pytest.mark.unit
def test_resolution_flags_count_cases_and_warn():
    s = hand_summaries()
    s["region_ess"] = np.array([50.0, 300.0])
    s["edge_mass"] = np.array([0.0, 0.2])
    s["disagreement"] = np.array([1.5, np.nan])
    out = analysis_metrics.resolution_metrics(s, 200, [0.7], design="adaptive")
    assert out["flagged"] == {"few_effective_points": 1, "edge_mass": 1, "disagreement": 1, "any": 2}
    assert "2 of 2 cases are under-resolved" in out["warning"] and "refinement_stages" in out["warning"]
    # An enumerated lattice is exact: few effective points there are no problem.
    s["edge_mass"], s["disagreement"] = np.zeros(2), np.zeros(2)
    out = analysis_metrics.resolution_metrics(s, 200, [0.7], design="enumerate")
    assert out["flagged"]["any"] == 0 and out["warning"] is None
    out = analysis_metrics.resolution_metrics(s, 200, [0.7], design="sobol")
    assert out["flagged"]["few_effective_points"] == 1 and "1 of 2 cases" in out["warning"]
    s["ess"] = np.array([3.0, 5.0])  # a low ESS on an enumerated lattice is exact, not under-resolved
    assert analysis_metrics.resolution_metrics(s, 200, [0.7], design="enumerate")["warning"] is None
    json.dumps(out)


# ---------------------------------------------------------------- sample-based checks


@pytest.mark.unit
def test_wasserstein_1d_matches_a_shift_and_respects_weights():
    a = torch.linspace(0, 1, 1001, dtype=torch.float64)
    ones = torch.ones_like(a)
    assert analysis_metrics.wasserstein_1d(a, ones, a + 0.3, ones) == pytest.approx(0.3, abs=1e-9)
    # Weighting b's sample onto its left half moves its mean; W1 to a's left half is then small.
    b_weights = (a < 0.5).double()
    assert analysis_metrics.wasserstein_1d(
        a[a < 0.5], torch.ones(int((a < 0.5).sum()), dtype=torch.float64), a, b_weights
    ) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.unit
def test_sliced_wasserstein_reweighting_recovers_a_target():
    generator = torch.Generator().manual_seed(3)
    source = torch.randn(20000, 2, generator=generator, dtype=torch.float64)
    target = torch.randn(20000, 2, generator=generator, dtype=torch.float64) * 0.5 + torch.tensor([1.0, 0.0])
    # Exact density ratio target/source for N(μ, 0.25 I) over N(0, I).
    log_ratio = -((source - torch.tensor([1.0, 0.0])) ** 2).sum(1) / 0.5 + (source**2).sum(1) / 2
    unweighted = analysis_metrics.sliced_wasserstein(target, source, None, seed=1)
    reweighted = analysis_metrics.sliced_wasserstein(target, source, log_ratio, seed=1)
    assert reweighted < 0.25 * unweighted
    assert analysis_metrics.sliced_wasserstein(target, source, log_ratio, seed=1) == reweighted  # seeded


@pytest.mark.unit
def test_effective_sample_size():
    assert analysis_metrics.effective_sample_size(torch.zeros(50)) == pytest.approx(50)
    assert analysis_metrics.effective_sample_size(torch.tensor([0.0, -1e4, -1e4])) == pytest.approx(1.0)
    assert analysis_metrics.effective_sample_size(torch.tensor([1e6, 1e6])) == pytest.approx(2.0)


# ---------------------------------------------------------------- randomised (lattice) coverage


@pytest.mark.unit
def test_credibility_upper_adds_the_truths_ties():
    # Masses ∝ e^s at scores 2, 1, 1, 0: the truth at score 1 ties two candidates.
    scores = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    points = torch.arange(4, dtype=torch.float64)[:, None]
    q = torch.softmax(scores[0], 0)
    for truth, low, high in (
        (3.0, 0.0, 0.0),
        (2.0, 0.0, q[0]),
        (1.0, q[0], q[0] + q[1] + q[2]),
        (0.5, q[0] + q[1] + q[2], q[0] + q[1] + q[2]),
        (0.0, 1 - q[3], 1.0),
    ):
        s = hpd.hld_summaries(scores, torch.zeros(4), points, torch.tensor([truth]), [0.5])
        assert s["credibility"][0] == pytest.approx(float(low), abs=1e-15)
        assert s["credibility_upper"][0] == pytest.approx(float(high), abs=1e-15)


@pytest.mark.unit
def test_randomised_inside_spreads_the_tie_uniformly():
    low, high = np.array([0.1, 0.6, 0.2, 0.7, 0.5]), np.array([0.3, 0.9, 0.2, 0.7, 0.5])
    inside = analysis_metrics.randomised_inside(low, high, 0.68)
    # Below the tie: inside; within it: (α − low) / tie; without a tie: low < α, as `covered`.
    assert inside == pytest.approx([1.0, (0.68 - 0.6) / 0.3, 1.0, 0.0, 1.0])
    assert analysis_metrics.randomised_inside([0.68], [0.68], 0.68).tolist() == [0.0]


@pytest.mark.unit
def test_coverage_metrics_report_the_randomised_lattice_coverage():
    s = hand_summaries()
    truths = np.array([[0.5, 4.0], [3.0, 2.5]])
    # Without credibility fields the lattice coverage is the joint coverage.
    entry = analysis_metrics.coverage_metrics(s, truths, [0.7], ["a", "b"])["0.7"]
    assert entry["lattice"] == entry["joint"] and entry["lattice_interval"] == entry["interval"]
    # Case 0 is covered with a tie over [0.5, 0.9]; case 1 is not, without a tie.
    s["credibility"], s["credibility_upper"] = np.array([0.5, 0.8]), np.array([0.9, 0.8])
    entry = analysis_metrics.coverage_metrics(s, truths, [0.7], ["a", "b"])["0.7"]
    assert entry["lattice"] == pytest.approx((0.7 - 0.5) / 0.4 / 2) and entry["joint"] == 0.5
    assert entry["lattice_interval"] == pytest.approx(analysis_metrics.wilson_interval(0.5, 2))
    json.dumps(entry)


@pytest.mark.unit
def test_a_second_target_on_the_same_points_gives_what_it_gives_alone():
    # A constant log prior keeps the first target's order and regions (both are reused); a slope
    # reorders the points, and the summary is made afresh.
    generator = torch.Generator().manual_seed(3)
    points = torch.rand(4, 300, 2, generator=generator, dtype=torch.float64)
    scores = -40 * ((points - 0.5) ** 2).sum(dim=2)
    log_measure = torch.zeros(4, 300, dtype=torch.float64)
    first, _, ranking = hpd.weighted_summary(scores, log_measure, points, scores[:, 0], LEVELS)
    for second, kept in ((scores + 3.0, True), (scores + 5 * points[..., 0], False)):
        alone = hpd.weighted_summary(second, log_measure, points, second[:, 0], LEVELS)[0]
        beside, _, (order, _) = hpd.weighted_summary(
            second, log_measure, points, second[:, 0], LEVELS, (first, ranking)
        )
        assert (order is ranking[0]) == kept
        assert alone.keys() == beside.keys()
        for key, value in alone.items():
            assert torch.equal(value, beside[key]), key
