"""Adaptive candidates: analytic HLD bounds, exact measure, lattices, chunking, refined boxes."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import adaptive
import case_scores
import designs
import hpd

LEVELS = (0.68, 0.95)
# Chi-square quantiles from standard tables: the squared radius of a p-D HLD ball per level.
CHI2 = {(1, 0.68): 0.98895, (1, 0.95): 3.84146, (3, 0.68): 3.50588, (3, 0.95): 7.81473}


def box_of(p, high=10.0, steps=None):
    """The Box [0, high]^p, lattice axes where steps name a step."""
    return adaptive.support_box(
        torch.zeros(p, dtype=torch.float64), torch.full((p,), high, dtype=torch.float64), steps or [None] * p
    )


def adaptive_settings(total, coarse, stages=3):
    """The candidates section of an adaptive design."""
    return {"kind": "adaptive", "candidate_count": total, "coarse_count": coarse, "refinement_stages": stages}


def gaussian_score(centre, sd, target="exact"):
    """A score function of an isotropic Gaussian density: {target: −|θ − centre|² / (2 sd²)}."""

    def score(points):
        return {target: -0.5 * (((points - centre) / sd) ** 2).sum(dim=1)}

    return score


def refine_case(score_fn, coarse, truth, refinement, case=0):
    """One case refined on its own: refine_block on a block of one, with
    `score_fn(points (n, p)) -> {target: scores (n,)}`; results without the block axis,
    summaries as numpy arrays of one case."""

    def block_scores(points):
        return {target: values[None] for target, values in score_fn(points[0]).items()}

    block = adaptive.refine_block(block_scores, coarse, truth[None], [case], refinement)
    return {
        "points": block["points"][0],
        "log_measure": block["log_measure"][0],
        "scores": {t: s[0] for t, s in block["scores"].items()},
        "summaries": {t: hpd.host_summary(s) for t, s in block["summaries"].items()},
        "proposals": {t: c.mapped(lambda field: field[0]) for t, c in block["proposals"].items()},
        "evaluated": block["evaluated"],
    }


def refine(score, box, settings_, truth, seed=1, case=0, targets=1):
    """One case refined on the adaptive design of `settings_` (its coarse pass drawn here)."""
    p = box.low.numel()
    steps = [float(s) if lattice else None for s, lattice in zip(box.step, box.lattice)]
    points, log_measure = designs.make_candidates(box.low, box.high, steps, settings_, seed=3)
    sizes = designs.adaptive_sizes(p, settings_, targets)
    return refine_case(score, (points, log_measure), truth, adaptive.Refinement(box, LEVELS, sizes, seed), case)


def measured(result):
    """Points and log measure of the measured (non-probe) points of a refined case."""
    keep = torch.isfinite(result["log_measure"])
    return result["points"][keep], result["log_measure"][keep]


@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.unit
def test_adaptive_candidates_reproduce_analytic_hld_bounds(p):
    sd = 2.0 / math.sqrt(15)  # σ = 2, 15 observations: the study's posterior sd
    centre = torch.tensor([4.37, 6.12, 5.05][:p], dtype=torch.float64)
    truth = centre + 0.3
    result = refine(gaussian_score(centre, sd), box_of(p), adaptive_settings(4096, 256), truth)
    summary = result["summaries"]["exact"]
    assert result["evaluated"] == 4096
    np.testing.assert_allclose(summary["mode"][0], centre.numpy(), atol=0.25 * sd)  # the best point found
    for i, level in enumerate(LEVELS):
        half = math.sqrt(CHI2[p, level]) * sd  # projected half-width of the HLD ball
        np.testing.assert_allclose(summary["lower"][0, i], (centre - half).numpy(), atol=0.03 * half)
        np.testing.assert_allclose(summary["upper"][0, i], (centre + half).numpy(), atol=0.03 * half)
        assert abs(summary["mass"][0, i] - level) < 0.01
        inside_ball = float(((truth - centre) ** 2).sum()) / sd**2 <= CHI2[p, level]
        assert bool(summary["covered"][0, i]) == inside_ball
    assert summary["region_ess"][0] > 500
    assert summary["edge_mass"][0] < 1e-3 and summary["disagreement"][0] < 1


@pytest.mark.unit
def test_weights_integrate_the_prior_box_exactly_and_the_density_accurately():
    sd, p = 0.4, 2
    box = box_of(p, high=8.0)
    centre = torch.tensor([2.2, 5.9], dtype=torch.float64)
    result = refine(gaussian_score(centre, sd), box, adaptive_settings(2048, 128), centre)
    points, log_measure = measured(result)
    assert float(log_measure.exp().sum()) == pytest.approx(64.0, rel=1e-12)
    assert bool(((points >= 0) & (points <= 8)).all())
    # The importance weights also integrate the density: ∫ exp(score) dθ = 2π sd² (far from the edges).
    assert result["summaries"]["exact"]["log_normalizer"][0] == pytest.approx(math.log(2 * math.pi * sd**2), abs=0.02)


@pytest.mark.unit
def test_lattice_axes_keep_counting_measure():
    sd, step = 0.6, 0.2
    box = box_of(2, steps=[step, None])
    centre = torch.tensor([3.3, 6.7], dtype=torch.float64)
    result = refine(gaussian_score(centre, sd), box, adaptive_settings(2048, 128), centre)
    points, log_measure = measured(result)
    lattice = designs.lattice_support(0.0, 10.0, step)
    assert torch.isin(result["points"][:, 0], lattice).all()  # probes too: only lattice values
    assert len({tuple(row) for row in points.tolist()}) == points.shape[0]  # repeats merged
    assert float(log_measure.exp().sum()) == pytest.approx(51 * 10.0, rel=1e-12)
    # Σ_k exp(−(θ_k − c)²/2sd²) · ∫ exp(−(θ − c)²/2sd²) dθ: counting measure times Lebesgue.
    exact = float(torch.exp(-0.5 * ((lattice - centre[0]) / sd) ** 2).sum()) * math.sqrt(2 * math.pi) * sd
    assert result["summaries"]["exact"]["log_normalizer"][0] == pytest.approx(math.log(exact), abs=0.02)


@pytest.mark.unit
def test_all_lattice_box_too_large_to_enumerate_is_refined_on_the_lattice():
    box = box_of(3, steps=[0.2, 0.2, 0.2])
    settings_ = dict(adaptive_settings(2048, 128), max_enumerated=1000)
    assert designs.candidate_design(3, [0.2] * 3, box.low, box.high, settings_) == "adaptive"
    centre = torch.tensor([4.0, 2.2, 7.6], dtype=torch.float64)
    result = refine(gaussian_score(centre, 0.5), box, settings_, centre)
    points, log_measure = measured(result)
    assert torch.isin(points, designs.lattice_support(0.0, 10.0, 0.2)).all()
    assert float(log_measure.exp().sum()) == pytest.approx(51.0**3, rel=1e-12)
    np.testing.assert_allclose(result["summaries"]["exact"]["mode"][0], centre.numpy(), atol=1e-9)


def small_network(d, p):
    """A tiny real MLP logit network."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(d + p, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


@pytest.mark.unit
def test_results_do_not_depend_on_chunk_rows():
    p, m = 2, 7
    net = small_network(p, p)
    observations = torch.randn(m, p, generator=torch.Generator().manual_seed(2)) + 5
    box = box_of(p)

    def run(chunk_rows):
        def score(points):
            with torch.no_grad():
                ratio = case_scores.ensemble_scores(
                    lambda rows: net(rows).squeeze(-1), observations, points, chunk_rows
                )
            return {"ratio": ratio, "posterior": ratio - 0.1 * points[:, 0]}

        return refine(
            score, box, adaptive_settings(1536, 128), torch.tensor([5.0, 5.0], dtype=torch.float64), targets=2
        )

    reference = run(case_scores.EVAL_BLOCK_ROWS)
    for chunk_rows in (20_000, 10**7):
        other = run(chunk_rows)
        assert torch.equal(other["points"], reference["points"])
        for target in ("ratio", "posterior"):
            for name, value in reference["summaries"][target].items():
                np.testing.assert_array_equal(other["summaries"][target][name], value)


@pytest.mark.unit
def test_exact_scores_refine_identically_whatever_the_chunk():
    centre = torch.tensor([3.1, 7.4], dtype=torch.float64)
    observations = centre + torch.randn(15, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def log_likelihood(x, theta):
        return (-0.5 * ((x - theta) / 2.0) ** 2).sum(dim=-1)

    def run(chunk_rows):
        def score(points):
            return {"exact": case_scores.exact_scores(log_likelihood, observations, points, chunk_rows)}

        return refine(score, box_of(2), adaptive_settings(1536, 128), centre)["summaries"]["exact"]

    reference = run(case_scores.EVAL_BLOCK_ROWS)
    for chunk_rows in (15, 1000, 10**6):
        for name, value in run(chunk_rows).items():
            np.testing.assert_array_equal(value, reference[name])


@pytest.mark.unit
def test_a_case_is_deterministic_from_seed_and_case_index():
    score = gaussian_score(torch.tensor([4.0, 4.0], dtype=torch.float64), 0.5)
    truth = torch.tensor([4.0, 4.0], dtype=torch.float64)
    first = refine(score, box_of(2), adaptive_settings(1024, 64), truth, seed=9, case=3)
    again = refine(score, box_of(2), adaptive_settings(1024, 64), truth, seed=9, case=3)
    other = refine(score, box_of(2), adaptive_settings(1024, 64), truth, seed=9, case=4)
    assert torch.equal(first["points"], again["points"])
    assert not torch.equal(first["points"], other["points"])


@pytest.mark.unit
def test_too_small_a_candidate_count_is_refused_clearly():
    with pytest.raises(ValueError, match="candidate_count=600 is too small.*raise candidate_count"):
        designs.adaptive_sizes(3, adaptive_settings(600, 128), 1)
    sizes = designs.adaptive_sizes(3, adaptive_settings(4096, 128), 2)
    assert sizes["probes"] == 2 * 2 * 3 * (designs.PROBE_RADII + designs.PROBE_REFINE)
    assert sizes["coarse"] + sum(sizes["passes"]) + sizes["probes"] == 4096 == sizes["total"]


@pytest.mark.unit
def test_proposal_density_matches_a_direct_formula():
    box = box_of(3, steps=[None, 0.5, None])
    generator = torch.Generator().manual_seed(0)
    proposals = [
        adaptive.Proposal(
            torch.rand(3, generator=generator, dtype=torch.float64) * 10,
            torch.rand(3, generator=generator, dtype=torch.float64) + 0.5,
            torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64),
            torch.tensor([9.0, 8.5, 9.5], dtype=torch.float64),
            10,
        )
        for _ in range(3)
    ]
    points = box.snap(torch.rand(40, 3, generator=generator, dtype=torch.float64) * 10)
    # A block of one case: the proposals' fields and the points gain a leading case axis.
    block = [adaptive.Proposal(*(field[None] for field in proposal[:4]), proposal.count) for proposal in proposals]
    got = adaptive.proposal_log_density(adaptive.stack_proposals(block), points[None], box)[0]

    def cdf(v):
        return 0.5 * math.erfc(-v / math.sqrt(2))

    for c, proposal in enumerate(proposals):
        for i, x in enumerate(points.tolist()):
            total = 0.0
            for j, value in enumerate(x):
                mean, sd = float(proposal.mean[j]), float(proposal.sd[j])
                half = 0.25 if j == 1 else 0.0  # a lattice point owns the cell ± half a step
                a, b = float(proposal.low[j]) - half, float(proposal.high[j]) + half
                norm = cdf((b - mean) / sd) - cdf((a - mean) / sd)
                if j == 1:
                    total += math.log((cdf((value + half - mean) / sd) - cdf((value - half - mean) / sd)) / norm)
                else:
                    z = (value - mean) / sd
                    total += -0.5 * z * z - 0.5 * math.log(2 * math.pi) - math.log(sd * norm)
            inside = bool(((points[i] >= proposal.low) & (points[i] <= proposal.high)).all())
            if inside:
                assert float(got[c, i]) == pytest.approx(total, abs=1e-8)
            else:
                assert float(got[c, i]) == -math.inf


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 3),
    lattice=st.lists(st.booleans(), min_size=3, max_size=3),
    centre=st.lists(st.floats(-5.0, 15.0), min_size=3, max_size=3),
    log_sd=st.floats(-3.0, 2.0),
    second=st.floats(0.0, 1.0),
    seed=st.integers(0, 1000),
)
@pytest.mark.property
def test_refined_boxes_always_contain_the_coarse_mode(p, lattice, centre, log_sd, second, seed):
    steps = [0.5 if flag else None for flag in lattice[:p]]
    box = box_of(p, steps=steps)
    centre = torch.tensor(centre[:p], dtype=torch.float64)
    sd = math.exp(log_sd)

    def score(points):  # one or two bumps, centres possibly outside the box
        first = -0.5 * (((points - centre) / sd) ** 2).sum(dim=1)
        other = -0.5 * (((points - (10 - centre)) / (2 * sd)) ** 2).sum(dim=1) + math.log(second + 1e-12)
        return {"ratio": torch.logaddexp(first, other), "posterior": first}

    settings_ = dict(adaptive_settings(768, 32), max_enumerated=10)
    coarse, coarse_log_measure = designs.make_candidates(box.low, box.high, steps, settings_, seed=seed)
    sizes = designs.adaptive_sizes(p, settings_, 2)
    result = refine_case(
        score, (coarse, coarse_log_measure), centre.clamp(0, 10), adaptive.Refinement(box, LEVELS, sizes, seed)
    )
    coarse_scores = score(coarse)
    for target, proposal in result["proposals"].items():
        mode = coarse[int(torch.argmax(coarse_scores[target]))]
        assert bool(((proposal.low <= mode) & (mode <= proposal.high)).all())
        assert bool(((box.low <= proposal.low) & (proposal.high <= box.high)).all())
    points, log_measure = measured(result)
    assert bool(((points >= box.low) & (points <= box.high)).all())
    assert float(torch.logsumexp(log_measure, 0)) == pytest.approx(box.log_measure(), abs=1e-9)
    assert result["evaluated"] == 768


@settings(max_examples=60, deadline=None)
@given(
    cases=st.integers(1, 4),
    components=st.integers(1, 3),
    p=st.integers(1, 3),
    n=st.integers(1, 30),
    spread=st.floats(0.0, 3.0),
    seed=st.integers(0, 10**6),
)
@pytest.mark.property
def test_points_in_boxes_compare_only_the_sides_a_point_may_cross(cases, components, p, n, spread, seed):
    generator = torch.Generator().manual_seed(seed)
    columns = torch.rand(cases, p, n, generator=generator, dtype=torch.float64) * 10
    centre = torch.rand(cases, components, p, generator=generator, dtype=torch.float64) * 10
    low, high = centre - spread * 4, centre + spread * 4  # from boxes that hold nothing to all of it
    low[..., 0] = torch.minimum(low[..., 0], columns[:, None, 0].amin(dim=2))  # one side never crossed
    brute = ((columns[:, None] >= low[..., None]) & (columns[:, None] <= high[..., None])).all(dim=2)
    inside = adaptive._inside_boxes(columns, low, high)
    if inside is None:
        assert bool(brute.all())
    else:
        assert torch.equal(inside, brute)
    nan = columns.clone()
    nan[0, 0, 0] = math.nan  # a NaN point lies in no box
    assert not bool(adaptive._inside_boxes(nan, low.clamp(max=0), high.clamp(min=10))[0, :, 0].any())


@pytest.mark.parametrize("p", [1, 6, 13])
@pytest.mark.unit
def test_every_case_s_draws_are_its_own_sobol_engine_s(p):
    seeds = [adaptive.case_seed(4, case) for case in range(5)]
    for count in (1, 2, 3, 1023, 1025, 8448):
        drawn = adaptive._case_draws(seeds, count, p, torch.device("cpu"))
        engines = torch.stack(
            [
                torch.quasirandom.SobolEngine(p, scramble=True, seed=seed).draw(count, dtype=torch.float64)
                for seed in seeds
            ]
        )
        assert torch.equal(drawn, engines)
