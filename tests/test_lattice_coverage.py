"""Coverage on a lattice prior: the plain HPD coverage of the exact likelihood exceeds its level (the
smallest region reaching α holds more than α), the randomised `lattice` coverage is nominal."""

import math

import numpy as np
import pytest
import torch

import adaptive
import analysis_metrics
import case_blocks
import designs
import hpd
import nre_analysis
import priors
import settings_analysis
from helpers import LEVELS, log_likelihood, study_problem
from store import Writer

pytestmark = pytest.mark.unit


def lattice_exact_summaries(tmp_path, problem, lattice_steps, cases, seed):
    """The exact target's summaries of `cases` default-profile truths on the prior's own candidates."""
    analysis = settings_analysis.make_settings("default")["inference"]
    truths = designs.make_truths(
        problem.low, problem.high, problem.grid_step, dict(analysis["truths"], sobol_truths=cases), seed=seed
    )
    observations = designs.make_observations(problem.simulate, truths, analysis["observations"], seed=seed + 1)
    candidates = dict(analysis["candidates"], kind="sobol", candidate_count=1024)
    points, log_measure = designs.make_candidates(problem.low, problem.high, lattice_steps, candidates, seed)
    writer = Writer(tmp_path)

    scoring = case_blocks.exact_scoring(log_likelihood, observations, torch.device("cpu"), 1 << 24)
    box = adaptive.support_box(problem.low, problem.high, lattice_steps)
    design = case_blocks.Design("sobol", list(lattice_steps), adaptive.Refinement(box, LEVELS, None, seed))
    work = nre_analysis.Cases(
        ["exact"], truths, case_blocks.Candidates(points, log_measure), {"mode": "diagnostic", "cases": 0}
    )
    nre_analysis.summarise_cases(writer, scoring, design, work, lambda case: None)
    summaries = {field: np.load(tmp_path / f"exact_{field}.npy") for field in nre_analysis.SUMMARY_FIELDS}
    return truths, points, summaries


def test_exact_lattice_coverage_is_nominal_on_the_grid_prior_where_plain_coverage_is_not(tmp_path, one_thread):
    problem = study_problem(1)
    prior = priors.make_prior(problem, {"family": "grid"})
    assert prior.lattice_steps == [pytest.approx(0.2)]
    cases = 1024  # the README's exact-target truths and observations (bench/bench_resolution.py)
    truths, points, summaries = lattice_exact_summaries(tmp_path, problem, prior.lattice_steps, cases, seed=1)
    assert points.shape == (51, 1) and truths.shape == (cases, 1)  # the lattice, enumerated
    # Every truth is a lattice point and a candidate: its own mass is its tie.
    assert (summaries["credibility_upper"] > summaries["credibility"]).all()
    mass = summaries["mass"].mean(axis=0)
    assert mass[0] > 0.74 and mass[1] > 0.96  # the smallest regions reaching α hold more than α
    coverage = analysis_metrics.coverage_metrics(summaries, truths.numpy(), LEVELS, problem.names)
    for level, excess in zip(LEVELS, (0.05, 0.01)):
        entry = coverage[analysis_metrics.level_key(level)]
        se = math.sqrt(level * (1 - level) / cases)
        # The randomised coverage is nominal within binomial noise (the truths' distance from the box's
        # edges lowers it by about 0.003 and 0.004, as it does on a continuous prior).
        assert abs(entry["lattice"] - level) < 3 * se, entry
        assert entry["lattice_interval"][0] < entry["lattice"] < entry["lattice_interval"][1]
        # The plain coverage is not (about 0.75 and 0.96): the regions hold more than α.
        assert entry["joint"] - entry["lattice"] > excess, entry


def test_randomised_coverage_is_exactly_nominal_on_an_unbounded_lattice():
    # Truths far from the box's edges (as on an infinite lattice): the coverage of the randomised
    # regions is nominal at every level, tightly, and that of the plain regions is far above.
    problem = study_problem(1)
    cases = 16384
    truths = designs.make_truths(
        problem.low,
        problem.high,
        problem.grid_step,
        {"kind": "sobol", "sobol_truths": cases, "truth_margin_fraction": 0.3},
        seed=2,
    )
    observations = designs.make_observations(problem.simulate, truths, 15, seed=3)
    points = designs.lattice_support(0.0, 10.0, 0.2)[:, None]
    scores = log_likelihood(observations[:, None], points[None, :, None]).sum(dim=2)
    truth_scores = log_likelihood(observations, truths[:, None]).sum(dim=1)
    levels = [0.5, 0.68, 0.9, 0.95]
    summaries = hpd.hld_summaries(scores, torch.zeros(points.shape[0]), points, truth_scores, levels)
    coverage = analysis_metrics.coverage_metrics(summaries, truths.numpy(), levels, problem.names)
    for level in levels:
        entry = coverage[analysis_metrics.level_key(level)]
        se = math.sqrt(level * (1 - level) / cases)
        assert abs(entry["lattice"] - level) < 3 * se, entry
        assert entry["joint"] - level > 5 * se, entry


def test_lattice_coverage_is_joint_coverage_on_a_continuous_prior(tmp_path, one_thread):
    problem = study_problem(1)
    truths, _, summaries = lattice_exact_summaries(tmp_path, problem, [None], 512, seed=3)
    coverage = analysis_metrics.coverage_metrics(summaries, truths.numpy(), LEVELS, problem.names)
    for level in LEVELS:
        entry = coverage[analysis_metrics.level_key(level)]
        assert entry["lattice"] == entry["joint"] and entry["lattice_interval"] == entry["interval"]
