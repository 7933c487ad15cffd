"""What is computed from the Weibull example's models: the kit's whole analysis (docs/extending.md).

Only what differs from the kit's defaults (inference_settings.INFERENCE_DEFAULTS, docs/extending.md):
every truth (512 × 2 Sobol points over the whole box, one observation of six lifetimes each) is
scored on a fixed Sobol design of candidates instead of the default adaptive one; the "exact"
target, a default since the study gives its likelihood, repeats the analysis with it.
"""

PROFILES = ("quick",)


def make_settings(profile):
    """The quick profile's analysis."""
    return {
        "analysis": "nre_analysis:NREAnalysis",
        "inference": {"candidates": {"kind": "sobol", "candidate_count": 2048}},
    }
