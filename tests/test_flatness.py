"""The flatness rule (flatness.flatness_report) on known cases, and the Python posterior that warns of it.

Known cases: a prior-like posterior (a network that has learned nothing) is flat; informative ones are
not, among them the damped oscillator of issue 37 (exact posterior sds 0.32-0.36 of the prior's in its
three parameters, a learned one about 1.5 times wider), which the earlier rule (any sd above half the
prior's) called "nearly flat".
"""

import warnings

import pytest
import torch

import posterior as post
import priors
from flatness import FLAT_INFORMATION, FLAT_SD_SHARE, flatness_report
from helpers import study_problem

pytestmark = pytest.mark.unit

NAMES = ["frequency", "damping", "noise"]
PRIOR_SD = [1.0, 1.0, 1.0]


class TemperedLogit(torch.nn.Module):
    """A 'network' whose logit is `temper` times the exact log-likelihood: 0 has learned nothing, 1/k² widens
    the exact posterior k times."""

    def __init__(self, problem, temper):
        super().__init__()
        self.problem, self.temper = problem, temper

    def forward(self, rows):
        d = self.problem.dimension
        return (self.temper * self.problem.log_likelihood(rows[:, :d].double(), rows[:, d:].double())).float()


def bundled_posterior(temper, observations, dimension=3):
    """The posterior of the bundled Gaussian problem (means in [0, 10]^d, σ = 2) at the box's centre from
    `observations` draws, with the likelihood tempered: its sd is 2/√(m·temper), of the prior's 2.89."""
    problem = study_problem(dimension)
    prior = priors.make_prior(problem, {"family": "uniform"})
    truth = torch.full((observations, dimension), 5.0, dtype=torch.float64)
    x = problem.simulate(truth, torch.Generator().manual_seed(3))
    learned = post.Learned(problem, prior, TemperedLogit(problem, temper), None, 1)
    return post.for_observation(learned, x)


@pytest.mark.parametrize(
    "shares, flat",
    [
        ([1.0, 1.0, 1.0], True),  # the prior itself
        ([0.97, 0.93, 0.99], True),  # an untrained model's posterior
        ([0.34, 0.32, 0.36], False),  # the oscillator's exact posterior
        ([0.51, 0.48, 0.54], False),  # the oscillator's learned posterior, 1.5 times wider
        ([0.58, 0.97], False),  # weibull: one parameter barely constrained by six lifetimes
        ([0.3, 1.0, 1.0], False),  # one parameter well measured: informative as a whole
    ],
)
def test_the_rule_on_known_cases(shares, flat):
    report = flatness_report(NAMES[: len(shares)], shares, PRIOR_SD[: len(shares)], auc=0.9)
    assert report["flat"] is flat and (report["warning"] is not None) is flat
    assert report["sd_share"] == pytest.approx(shares)


def test_a_flat_posterior_names_its_wide_parameters_and_the_likely_cause():
    report = flatness_report(NAMES, [0.99, 0.8, 0.98], PRIOR_SD, auc=0.6)
    assert report["parameters"] == ["frequency", "noise"] and report["joint_sd_share"] > FLAT_SD_SHARE
    assert "nearly flat in frequency, noise" in report["warning"] and "learned little" in report["warning"]


@pytest.mark.parametrize(
    "temper, observations, flat",
    [
        (0.0, 4, True),  # learned nothing: the prior
        (1.0, 4, False),  # sd 1.0 of 2.89: 0.35 of the prior's, the oscillator's exact share
        (1 / 2.25, 4, False),  # 1.5 times wider: 0.52, called flat by the earlier rule
        (1.0, 1, False),  # one observation: 0.69
    ],
)
def test_posteriors_of_known_width_are_judged_by_the_rule(temper, observations, flat):
    posterior = bundled_posterior(temper, observations)
    report = posterior.flatness(validation_auc=0.9)
    assert report["flat"] is flat, report["sd_share"]


class ThinRing(torch.nn.Module):
    """A 'network' whose posterior is a thin ring of radius 3.5 around the box's centre (radial sd 0.1)."""

    def forward(self, rows):
        radius = (rows[:, -2:].double() - 5.0).norm(dim=1)
        return (-0.5 * ((radius - 3.5) / 0.1) ** 2).float()


def test_a_thin_ring_with_the_priors_sds_is_informative_not_flat():
    problem = study_problem(2)
    prior = priors.make_prior(problem, {"family": "uniform"})
    x = torch.full((1, 2), 5.0, dtype=torch.float64)
    ring = post.for_observation(post.Learned(problem, prior, ThinRing(), None, 1), x)
    report = ring.flatness(validation_auc=0.99)
    # Its sds are those of a circle of radius 3.5 (2.47 per axis, 0.86 of the prior's 2.89): wide as
    # the prior's by the sds alone, yet the ring rules out most of the box.
    assert report["joint_sd_share"] > FLAT_SD_SHARE
    assert report["information"] > 2 * FLAT_INFORMATION and report["flat"] is False and report["warning"] is None
    # The same sds with no information measured would be called flat: the information decides.
    assert flatness_report(NAMES[:2], report["sd_share"], [1.0, 1.0], auc=0.99)["flat"] is True
    # A prior-like posterior holds none.
    assert bundled_posterior(0.0, 4, dimension=2).information == pytest.approx(0.0, abs=1e-9)


def test_the_python_posterior_warns_what_infer_prints():
    posterior = bundled_posterior(0.0, 4, dimension=1)
    history = {"selected_epoch": 1, "validation": [{"bce": 0.69, "auc": 0.5}]}
    with pytest.warns(post.PosteriorWarning, match="nearly flat in mean:0") as caught:
        report = posterior.report_flatness(history)
    assert posterior.warnings == [report["warning"]] == [str(caught[0].message)]
    assert posterior.flat is report and "validation AUC 0.50" in report["warning"]
    assert caught[0].filename == __file__  # warned at the caller's line


def test_an_informative_posterior_warns_nothing():
    posterior = bundled_posterior(1.0, 4, dimension=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = posterior.report_flatness({})
    assert report["flat"] is False and posterior.warnings == [] and report["validation_auc"] is None


def test_without_the_priors_sds_nothing_is_called_flat():
    report = flatness_report(NAMES, [1.0, 1.0, 1.0], None, auc=0.5)
    assert report["flat"] is False and report["sd_share"] == [None] * 3 and report["joint_sd_share"] is None
