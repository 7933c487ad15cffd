"""The sample-based checks of the Gaussian study with exact ratios: reweighting and normalisation."""

import pytest
import torch

import analysis_metrics
import gaussian
import nre_analysis
import nre_study
import priors
from settings_training import make_settings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["uniform", "normal", "exponential", "grid"])
def test_exact_ratio_reweights_product_pairs_onto_joint_pairs(family):
    settings = make_settings("smoke")
    problem = gaussian.GaussianProblem.from_settings(settings["problem"])
    prior = priors.make_prior(problem, settings["priors"][family])
    inputs, labels = nre_study.sample_pairs(problem, prior, 4000, torch.Generator().manual_seed(1))
    log_ratio = nre_analysis.bayes_optimal_logits(problem, prior, inputs.double(), seed=2)
    joint, product, weights = inputs[labels == 1], inputs[labels == 0], log_ratio[labels == 0]
    unweighted = analysis_metrics.sliced_wasserstein(joint, product, None)
    reweighted = analysis_metrics.sliced_wasserstein(joint, product, weights)
    assert reweighted < 0.4 * unweighted
    # E over the evidence of r(x, θ) is 1 (Monte Carlo, a few standard errors).
    ratios = torch.exp(weights)
    assert abs(ratios.mean().item() - 1) < 4 * ratios.std().item() / len(ratios) ** 0.5
    assert analysis_metrics.effective_sample_size(weights) > 0.2 * len(weights)
