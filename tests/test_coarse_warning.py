"""`plan` predicts, before any compute, when an adaptive design's coarse pass is too sparse for the
dimension (nre_analysis.MIN_COARSE_NEIGHBOURS), and names the setting to raise; it stays silent on
the bundled profiles and where the coarse pass suffices. Every case is the real command line."""

import json
import math
import re

import pytest

from helpers import run_cli, side_by_side, write_settings
from nre_analysis import MIN_COARSE_NEIGHBOURS, chi_square_quantile

pytestmark = pytest.mark.launch

# The base settings' candidates (coarse_count 64, candidate_count 1024, refinement_stages 3), adaptive.
ADAPTIVE = 'settings["inference"]["candidates"]["kind"] = "adaptive"\n'
WARNED = re.compile(
    r"coarse pass of (\d+) points puts about ([\d.]+) inside .*raise "
    r"inference\.candidates\.coarse_count to about ([\d,]+)(?: and candidate_count to at least "
    r"([\d,]+), which that needs)?$"
)


def plan_of(folder, dimension=None, analysis=ADAPTIVE, profile="smoke"):
    """The JSON of `nnpd.py plan` for the base settings at a dimension (None: the bundled profile itself)."""
    if dimension is None:
        result = run_cli("plan", "--profile", profile)
    else:
        settings = write_settings(
            folder / "settings",
            folder / "out",
            tiny=False,
            analysis=analysis,
            training=f'settings["problem"]["dimension"] = {dimension}\n',
        )
        result = run_cli("plan", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def coarse_lines(plan):
    """The plan's coarse-pass warnings."""
    return [line for line in plan["warnings"] if "coarse pass" in line]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Every plan these tests read, launched side by side."""
    calls = {
        6: lambda: plan_of(tmp_path_factory.mktemp("d6"), 6),
        1: lambda: plan_of(tmp_path_factory.mktemp("d1"), 1),
        3: lambda: plan_of(tmp_path_factory.mktemp("d3"), 3),
        "fixed": lambda: plan_of(
            tmp_path_factory.mktemp("fixed"),
            6,
            analysis=ADAPTIVE
            + ('settings["inference"]["candidates"].update(coarse_count=477, candidate_count=2676)\n'),
        ),
        "smoke": lambda: plan_of(None, profile="smoke"),
        "default": lambda: plan_of(None, profile="default"),
    }
    return side_by_side(calls, limit=3)


def test_plan_warns_at_d6_with_the_base_coarse_count_and_names_the_fix(plans):
    plan = plans[6]
    assert plan["errors"] == []
    (line,) = coarse_lines(plan)  # one line for the configuration, naming every prior short of points
    assert line.startswith("configuration ") and "inference.candidates: the adaptive design's" in line
    assert "priors uniform, normal, exponential, grid" in line
    coarse, near, needed, total = WARNED.search(line).groups()
    assert int(coarse) == 64
    # The grid prior's lattice widens the box by a step per axis, so it is the sparsest:
    # 64 · (π³/6)·(2·√χ²₆(0.95))⁶·(2/√15)⁶ / 10.2⁶ ≈ 0.71 coarse points near a posterior.
    expected = 64 * math.pi**3 / 6 * (4 * chi_square_quantile(0.95, 6)) ** 3 * (2 / math.sqrt(15)) ** 6 / 10.2**6
    assert float(near) == pytest.approx(expected, rel=2e-3) and float(near) < MIN_COARSE_NEIGHBOURS
    assert int(needed.replace(",", "")) == math.ceil(64 * MIN_COARSE_NEIGHBOURS / expected) == 477
    # The learned product refines two targets: 477 · (3 + 1) points and 2 · 2 · 6 · 32 probes.
    assert int(total.replace(",", "")) == 477 * 4 + 768


def test_the_suggested_coarse_count_silences_the_warning(plans):
    assert plans["fixed"]["errors"] == [] and coarse_lines(plans["fixed"]) == []


@pytest.mark.parametrize("case", [1, 3, "smoke", "default"])
def test_no_false_alarm_where_the_coarse_pass_suffices(plans, case):
    assert plans[case]["errors"] == []
    assert coarse_lines(plans[case]) == []
    if case in ("smoke", "default"):
        assert plans[case]["warnings"] == []
