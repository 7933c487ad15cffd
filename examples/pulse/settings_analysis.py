"""What is computed from the pulse example's models: the kit's analysis (nre_analysis.py).

Only what differs from the kit's defaults (inference_settings.INFERENCE_DEFAULTS, docs/extending.md):
fewer truths in the quick profile, so its analysis takes seconds, and every metric but
`reweighting` and `normalization`: their Monte Carlo evidence costs 20,000 likelihoods of 200
samples per test simulation (minutes). The "exact" target, a default since the study gives its
likelihood, repeats the analysis with the exact likelihood.
"""

PROFILES = ("quick", "full")


def make_settings(profile):
    """The analysis settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    return {
        "analysis": "nre_analysis:NREAnalysis",
        "inference": {"truths": {"sobol_truths": 128 if profile == "quick" else 512}},
        "metrics": [
            "classification",
            "bias",
            "coverage",
            "width",
            "resolution",
            "posterior",
            "exact_reference",
            "expected_coverage",
            "pairwise",
        ],
    }
