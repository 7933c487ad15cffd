"""The exact target at dimension 6: adaptive candidates resolve it, a fixed design of the same size warns."""

import math

import pytest
import torch

import analysis_metrics
import designs
import settings_analysis
from helpers import LEVELS, exact_summaries, log_likelihood, study_problem

RADIUS_68 = math.sqrt(7.009170)  # √χ²_6(0.68): 1 − e^{−x/2}(1 + x/2 + x²/8) = 0.68


@pytest.mark.unit
def test_the_fast_likelihood_is_the_study_likelihood():
    problem = study_problem(3)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(5, 1, 3, generator=generator, dtype=torch.float64) * 10
    theta = torch.rand(1, 7, 3, generator=generator, dtype=torch.float64) * 10
    torch.testing.assert_close(log_likelihood(x, theta), problem.log_likelihood(x, theta), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.launch
def test_dimension_six_exact_target_is_resolved_by_adaptive_candidates_only(tmp_path, one_thread):
    problem = study_problem(6)
    analysis = settings_analysis.make_settings("default")["inference"]
    truths = designs.make_truths(
        problem.low, problem.high, problem.grid_step, dict(analysis["truths"], sobol_truths=32), seed=1
    )
    assert truths.shape == (1024, 6)
    observations = designs.make_observations(problem.simulate, truths, analysis["observations"], seed=2)
    names = problem.names
    adaptive = exact_summaries(tmp_path, problem, truths, observations, analysis["candidates"], "adaptive")
    coverage = analysis_metrics.coverage_metrics(adaptive, truths.numpy(), LEVELS, names)
    for level in LEVELS:
        entry = coverage[analysis_metrics.level_key(level)]
        assert abs(entry["joint"] - level) <= 3 * math.sqrt(level * (1 - level) / 1024)
        assert entry["cases"] == 1024 and entry["interval"][0] < entry["joint"] < entry["interval"][1]
    assert coverage["0.68"]["mean"] >= 0.95
    analytic_width = 2 * RADIUS_68 * 2 / math.sqrt(15)
    assert abs(analysis_metrics.width_metrics(adaptive, LEVELS, names)["0.68"]["mean"] / analytic_width - 1) < 0.10
    resolution = analysis_metrics.resolution_metrics(
        adaptive, analysis["candidates"]["candidate_count"], LEVELS, "adaptive"
    )
    assert resolution["warning"] is None and resolution["flagged"]["any"] == 0
    # Today's fixed design of the same size, on the first 256 cases: nearly every one is flagged.
    fixed = exact_summaries(
        tmp_path, problem, truths[:256], observations, {"kind": "sobol", "candidate_count": 16384}, "fixed"
    )
    resolution = analysis_metrics.resolution_metrics(fixed, 16384, LEVELS, "sobol")
    assert resolution["warning"] is not None and resolution["flagged"]["few_effective_points"] > 250
