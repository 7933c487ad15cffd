"""Blocks of cases: a case's results are the same, to float32 rounding, whatever block it is refined or
summarised in, blocks stay inside their memory budget, and the CUDA policy puts millions of rows into a
network call."""

import functools
import json
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import adaptive
import case_blocks
import case_scores
import designs
import nre_analysis
from helpers import assert_same_but_rounding, run_cli, write_settings
from store import Writer

LEVELS = (0.68, 0.95)
CASES = 13  # the largest case count any test below uses
OBSERVATIONS = 5
DESIGNS = {
    "adaptive": {
        "kind": "adaptive",
        "candidate_count": 1536,
        "coarse_count": 128,
        "refinement_stages": 3,
        "max_enumerated": 10,
    },
    "sobol": {"kind": "sobol", "candidate_count": 512, "max_enumerated": 10},
}


def log_likelihood(x, theta):
    """Unit-variance Gaussian observations of θ, broadcasting."""
    return (-0.5 * (x - theta) ** 2).sum(dim=-1)


@functools.lru_cache(maxsize=None)
def problem(lattice):
    """Truths, observations, lattice steps and a real tiny network of a 2-parameter problem on [0, 10]²."""
    steps = [0.5, None] if lattice else [None, None]
    generator = torch.Generator().manual_seed(7)
    truths = torch.rand(CASES, 2, generator=generator, dtype=torch.float64) * 8 + 1
    if lattice:
        truths[:, 0] = torch.round(truths[:, 0] * 2) / 2
    observations = truths[:, None, :] + torch.randn(CASES, OBSERVATIONS, 2, generator=generator, dtype=torch.float64)
    torch.manual_seed(3)
    network = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).eval()
    return truths, observations, steps, network


def scorings(observations, network, blocks):
    """The learned (ratio, posterior) and exact scorings of blocks of cases; `blocks` records each block's size."""

    def learned(cases, points):
        blocks.append(points.shape[0])
        ratio = case_scores.ensemble_scores(
            lambda rows: network(rows).squeeze(-1), observations[cases], points, case_scores.EVAL_BLOCK_ROWS
        )
        return {"ratio": ratio, "posterior": ratio - 0.05 * points.sum(dim=2)}

    def exact(cases, points):
        return {"exact": case_scores.exact_scores(log_likelihood, observations[cases], points, 4096)}

    return {("ratio", "posterior"): learned, ("exact",): exact}


def analyse(design, lattice, cases, block_cases, blocks=None):
    """Every summary array and retained score of the first `cases` cases, refined `block_cases` at a time."""
    truths, observations, steps, network = problem(lattice)
    points, log_measure = designs.make_candidates(
        torch.zeros(2), torch.full((2,), 10.0), steps, DESIGNS[design], seed=3
    )
    box = adaptive.support_box(torch.zeros(2), torch.full((2,), 10.0), steps)
    with tempfile.TemporaryDirectory() as folder:
        for targets, score in scorings(observations, network, [] if blocks is None else blocks).items():
            summarise(
                Writer(Path(folder)),
                design,
                list(targets),
                score,
                truths[:cases],
                (points, log_measure),
                box,
                block_cases,
            )
        return {path.stem: np.load(path) for path in Path(folder).glob("*.npy")}


def summarise(writer, design, targets, score, truths, design_points, box, block_cases):
    """One product's summaries through the study's driver, with a memory budget of block_cases cases."""
    sizes = designs.adaptive_sizes(2, DESIGNS[design], len(targets)) if design == "adaptive" else None
    plan = case_blocks.Design(design, [None, None], adaptive.Refinement(box, LEVELS, sizes, 5))
    shared = case_blocks.Candidates(*design_points)
    per_case = case_blocks.design_case_bytes(plan, shared.points.shape[0], 2, len(targets))
    scoring = case_blocks.Scoring(score, torch.device("cpu"), block_cases * per_case)
    work = nre_analysis.Cases(targets, truths, shared, {"mode": "full", "cases": 0})
    nre_analysis.summarise_cases(writer, scoring, plan, work, lambda case: None)


@functools.lru_cache(maxsize=None)
def one_at_a_time(design, lattice):
    """Every case refined in a block of its own: the reference."""
    return analyse(design, lattice, CASES, 1)


def assert_same(results, reference, cases):
    """Every array of `results` is the reference's first `cases` rows: flags and counts bitwise, floating
    values to float32 rounding (a block's matrix products have other shapes, so other BLAS kernels)."""
    assert set(results) == set(reference)
    for key, value in results.items():
        assert_same_but_rounding(value, reference[key][:cases], key)


@pytest.mark.parametrize("design", ["adaptive", "sobol"])
@pytest.mark.parametrize("lattice", [False, True])
@pytest.mark.unit
def test_a_block_of_every_case_gives_the_per_case_results(design, lattice):
    reference = one_at_a_time(design, lattice)
    assert {"ratio_lower", "posterior_mode", "exact_credibility", "exact_scores"} <= set(reference)
    if design == "adaptive":
        assert "design_points" in reference
        if lattice:  # the lattice axis stays on the lattice, and repeats carry no measure of their own
            assert np.isin(reference["design_points"][:, :, 0], np.arange(0, 10.25, 0.5)).all()
    assert_same(analyse(design, lattice, CASES, CASES), reference, CASES)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    design=st.sampled_from(sorted(DESIGNS)),
    lattice=st.booleans(),
    cases=st.sampled_from([1, 7, CASES]),
    block_cases=st.integers(1, CASES + 3),
)
@pytest.mark.property
def test_results_do_not_depend_on_the_block_size_or_the_case_count(design, lattice, cases, block_cases):
    assert_same(analyse(design, lattice, cases, block_cases), one_at_a_time(design, lattice), cases)


@pytest.mark.unit
def test_a_block_larger_than_the_memory_budget_is_split():
    blocks = []
    results = analyse("adaptive", False, 10, 3, blocks)  # a budget of three cases' arrays
    # Each block is scored on its coarse design, three passes and two probe rounds.
    assert blocks == [3] * 6 + [3] * 6 + [3] * 6 + [1] * 6
    assert_same(results, one_at_a_time("adaptive", False), 10)
    assert case_scores.cases_per_block(1000, 10, 95) == 9 and case_scores.cases_per_block(5, 10, 10**9) == 5
    assert case_scores.cases_per_block(5, 10**9, 10) == 1  # one case always fits: it is the unit of work


@pytest.mark.unit
def test_the_cuda_policy_sizes_calls_from_free_memory_and_chunk_rows_caps_them():
    row_bytes = 2104  # the bundled network at d = 6
    policy = case_scores.call_policy("cuda", 1 << 24, row_bytes, free_bytes=80 * 10**9)
    assert (1 << 20) <= policy.rows_per_call <= (1 << 24) and policy.block_bytes == 20 * 10**9
    assert case_scores.call_policy("cuda", 1 << 24, row_bytes, free_bytes=10**12).rows_per_call == 1 << 24
    assert case_scores.call_policy("cuda", 5000, row_bytes, free_bytes=80 * 10**9).rows_per_call == 5000
    assert case_scores.call_policy("cpu", 1 << 24).rows_per_call == case_scores.EVAL_BLOCK_ROWS
    with pytest.raises(ValueError, match="chunk_rows"):
        case_scores.call_policy("cpu", 0)


class Uniform:
    """A uniform prior on [0, 10]: the learned product's log prior."""

    lattice_steps = [None]

    def log_prob(self, points):
        return torch.full(points.shape[:-1], -np.log(10.0), dtype=torch.float64)


@pytest.mark.unit
def test_the_cuda_policy_puts_millions_of_rows_into_each_network_call_of_the_learned_product():
    # The learned product's own scoring, on the CPU, with the block policy CUDA would choose.
    cases, observations = 256, 15
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    truths = torch.rand(cases, 1, dtype=torch.float64) * 8 + 1
    x = truths[:, None, :] + torch.randn(cases, observations, 1, dtype=torch.float64)
    settings_ = {"kind": "adaptive", "candidate_count": 2048, "coarse_count": 256, "refinement_stages": 3}
    policy = case_scores.call_policy("cuda", 1 << 24, case_scores.network_row_bytes(network, 2), free_bytes=16 << 30)
    counted = case_scores.Evaluations()
    scoring = case_blocks.learned_scoring(
        network, torch.device("cpu"), Uniform(), x, ["ratio", "posterior"], {"chunk_rows": 1 << 24}, counted, policy
    )
    points, log_measure = designs.make_candidates(torch.zeros(1), torch.full((1,), 10.0), [None], settings_, seed=1)
    box = adaptive.support_box(torch.zeros(1), torch.full((1,), 10.0), [None])
    refinement = adaptive.Refinement(box, LEVELS, designs.adaptive_sizes(1, settings_, 2), 5)
    design = case_blocks.Design("adaptive", [None], refinement)
    work = nre_analysis.Cases(
        ["ratio", "posterior"], truths, case_blocks.Candidates(points, log_measure), {"mode": "diagnostic", "cases": 0}
    )
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        nre_analysis.summarise_cases(Writer(Path(folder)), scoring, design, work, lambda case: None)
    assert counted.rows == cases * (2048 + 1) * observations
    assert counted.call_rows // counted.calls >= 1 << 20


def learned_artifacts(root):
    """The artifact records of every learned product in an output root's store."""
    return [json.loads(path.read_text()) for path in (root / "cache" / "learned").glob("*/artifact.json")]


@pytest.mark.launch
def test_a_launch_reports_each_product_s_rate_and_the_precision_keys_the_learned_product(trained_smoke_root, tmp_path):
    learned = learned_artifacts(trained_smoke_root)
    rate = json.loads((trained_smoke_root / "timings.json").read_text())["throughput"]["product.learned"]
    assert rate["evaluations"] == sum(a["metadata"]["model_evaluations"] for a in learned) > 0
    assert rate["evaluations_per_s"] > 0
    calls = sum(a["metadata"]["network_calls"] for a in learned)
    assert 0 < rate["rows_per_call"] <= case_scores.EVAL_BLOCK_ROWS and calls > 0
    subprocess.run(["cp", "-a", str(trained_smoke_root), str(tmp_path / "out")], check=True)
    settings_dir = write_settings(
        tmp_path / "s", tmp_path / "out", analysis='settings["inference"]["precision"] = "bfloat16"\n'
    )
    result = run_cli("analyze", "--settings-dir", str(settings_dir))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^  product\.learned: \S+ evaluations/s, [\d,]+ rows per network call$", result.stdout, re.M)
    old = {a["key"] for a in learned}
    made = [a for a in learned_artifacts(tmp_path / "out") if a["key"] not in old]
    assert len(made) == len(learned)  # every learned product was made again, under a new key
    assert {a["recipe"]["settings"]["inference"]["precision"] for a in made} == {"bfloat16"}
    assert {a["recipe"]["settings"]["inference"]["precision"] for a in learned} == {"float32"}
