"""What is computed from the decay-rate example's models: the kit's analysis (nre_analysis.py).

Only what differs from the kit's defaults (inference_settings.INFERENCE_DEFAULTS, docs/extending.md):
more truths (Sobol points filling the whole range of θ, one observation each), scored on a grid
of 512 values of θ. The "exact" target, a default since the study gives its likelihood, repeats
the analysis with the exact likelihood.
"""

PROFILES = ("quick", "full")


def make_settings(profile):
    """The analysis settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    return {
        "analysis": "nre_analysis:NREAnalysis",
        "inference": {
            "truths": {"sobol_truths": 1000 if profile == "quick" else 10_000},
            "candidates": {"kind": "grid", "candidate_points_per_axis": 512},
        },
        # Without "plots" and "cohort_plots" the kit draws its default figures (with matplotlib installed).
    }
