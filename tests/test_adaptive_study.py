"""The study with adaptive candidates: settings checks, plan warnings, a real run end to end."""

import json
import math
from pathlib import Path

import pytest

import jobs
import nnpd
import settings_analysis
import settings_training
from gaussian_study import GaussianAnalysis, GaussianExperiment
from helpers import write_settings
from nre_analysis import chi_square_quantile
from settings import SettingsError
from store import Store


def analysis_for(dimension, candidates, priors=("uniform",), targets=("ratio", "posterior", "exact")):
    """A GaussianAnalysis of the smoke study at a dimension with the given candidates section."""
    training = settings_training.make_settings("smoke")
    training["problem"]["dimension"] = dimension
    training["cohort"]["priors"] = list(priors)
    analysis = settings_analysis.make_settings("smoke")
    analysis["inference"]["candidates"].update(candidates)
    analysis["inference"]["targets"] = list(targets)
    return GaussianAnalysis(analysis, GaussianExperiment(training))


@pytest.mark.unit
def test_chi_square_quantiles_match_tables():
    assert chi_square_quantile(0.95, 1) == pytest.approx(3.841459, abs=1e-5)
    # Even degrees of freedom have a closed-form CDF: 1 − e^{−x/2}(1 + x/2 + (x/2)²/2) for 6.
    x = chi_square_quantile(0.68, 6)
    assert 1 - math.exp(-x / 2) * (1 + x / 2 + (x / 2) ** 2 / 2) == pytest.approx(0.68, abs=1e-9)
    assert chi_square_quantile(0.95, 6) == pytest.approx(12.591587, abs=1e-5)


@pytest.mark.unit
def test_plan_warns_when_a_fixed_design_under_resolves_before_any_compute():
    lines = analysis_for(6, {"kind": "sobol", "candidate_count": 16384}).plan_warnings()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("inference.candidates:") and "\n" not in line
    assert "fixed sobol design of 16384 points" in line and "kind to 'adaptive'" in line
    # (π³/6)·12.59³·(2/√15)⁶ over 10⁶: about 3.2 of the 16384 points inside a 0.95 region.
    expected = math.pi**3 / 6 * chi_square_quantile(0.95, 6) ** 3 * (2 / math.sqrt(15)) ** 6 / 1e6 * 16384
    assert f"about {expected:.3g} inside" in line
    assert analysis_for(6, {"kind": "adaptive", "candidate_count": 10240, "coarse_count": 1024}).plan_warnings() == []
    assert analysis_for(1, {"kind": "sobol", "candidate_count": 16384}).plan_warnings() == []
    grid = analysis_for(4, {"kind": "grid", "candidate_points_per_axis": 8}).plan_warnings()
    assert (
        len(grid) == 1
        and "fixed grid design of 4096 points" in grid[0]
        and grid[0].endswith("raise candidate_points_per_axis")
    )
    # An enumerated lattice is exact: nothing to warn about.
    assert analysis_for(2, {"kind": "sobol", "candidate_count": 16}, priors=("grid",)).plan_warnings() == []


@pytest.mark.unit
def test_adaptive_settings_are_checked_with_one_clear_line():
    analysis = analysis_for(3, {"kind": "adaptive", "candidate_count": 600, "coarse_count": 128})
    with pytest.raises(
        SettingsError,
        match=r"inference.candidates: candidate_count=600 is too small.*"
        r"raise candidate_count or lower coarse_count",
    ):
        analysis.validate()
    analysis_for(3, {"kind": "adaptive", "candidate_count": 2048, "coarse_count": 128}).validate()
    with pytest.raises(
        SettingsError, match="inference.candidates.kind: 'halton' is not valid; use one of 'sobol', 'grid', 'adaptive'"
    ):
        analysis_for(1, {"kind": "halton"}).validate()
    with pytest.raises(SettingsError, match="inference.candidates.refinement_stages: must be at least 1"):
        analysis_for(1, {"kind": "adaptive", "refinement_stages": 0}).validate()


@pytest.mark.unit
def test_the_default_profile_refines_and_stays_within_todays_evaluations():
    plan = nnpd.plan("default")
    assert plan["errors"] == []
    planned_jobs = [job for configuration in plan["configurations"] for job in configuration["jobs"]]
    assert sum(job["workload"]["model_evaluations"] for job in planned_jobs) <= 6.989e10
    assert settings_analysis.make_settings("default")["inference"]["candidates"]["kind"] == "adaptive"
    assert settings_analysis.make_settings("paper")["inference"]["candidates"]["kind"] == "sobol"


ADAPTIVE = """
settings["inference"]["candidates"].update(kind="adaptive", candidate_count=1024, coarse_count=64,
                                           max_enumerated=100)
settings["inference"]["diagnostic_cases"] = 2
settings["plots"] = ["diagnostic_cases"]
"""


@pytest.mark.launch
def test_an_adaptive_run_reports_intervals_and_resolution_and_evaluates_what_the_plan_said(tmp_path):
    root = tmp_path / "out"
    settings = write_settings(
        tmp_path / "s",
        root,
        analysis=ADAPTIVE,
        training='settings["problem"]["dimension"] = 2\nsettings["cohort"]["priors"] = ["uniform", "grid"]\n',
    )
    nnpd.execute("run", "smoke", settings)
    planned = {job["member"]: job for c in nnpd.plan("smoke", settings)["configurations"] for job in c["jobs"]}
    store = Store(root)
    for run in sorted(path.parent for path in Path(root, "runs").glob("*/*/run.json")):
        text = (run / "metrics.json").read_text()
        assert "NaN" not in text and "Infinity" not in text
        metrics = json.loads(text)
        for report in (metrics["coverage"], metrics["posterior"]["coverage"], metrics["exact_reference"]["coverage"]):
            for entry in report.values():
                assert entry["cases"] == 16
                low, high = entry["interval"]
                assert low <= entry["joint"] <= high
                assert all(a <= entry["per_axis"][name] <= b for name, (a, b) in entry["per_axis_interval"].items())
        assert metrics["resolution"]["design"] == "adaptive" and metrics["resolution"]["candidate_count"] == 1024
        assert set(metrics["exact_reference"]["resolution"]["flagged"]) == {
            "few_effective_points",
            "edge_mass",
            "disagreement",
            "any",
        }
        member = run.name.rsplit("-", 1)[0]
        artifacts = json.loads((run / "artifacts.json").read_text())
        learned = store.artifact_at(root / artifacts["learned"])
        workload = planned[member]["workload"]
        assert learned.metadata["model_evaluations"] == workload["model_evaluations"] == 16 * 1025 * 5
        assert learned.metadata["candidates"] == workload["candidate_points"]
        assert learned.array("design_points").shape == (2, 1024, 2)
        if not jobs.matplotlib_missing():  # the figure draws each retained case on its own points
            assert (run / "plots" / "diagnostic_cases.png").read_bytes().startswith(b"\x89PNG")
        if member.startswith("grid"):  # the lattice prior is refined on its lattice
            points = learned.array("design_points")[0]
            steps = points[~(points != points).any(axis=1)] / 0.2
            assert abs(steps - steps.round()).max() < 1e-9
