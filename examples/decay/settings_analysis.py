"""What is computed from the decay-rate example's models (examples/decay/decay_study.py).

Metrics: "classification" (held-out BCE, accuracy, AUC); per level, "coverage" (how
often the true θ lies in the learned highest-density region, "joint", and in the exact
one, with 95% Wilson intervals) and "width" (their mean length in θ); "bias" (error of
the learned and the exact posterior means of θ against the truth); "agreement" (mean
|learned − exact| posterior mean of θ, and the KL divergence from the exact to the
learned posterior on the grid). The figure
"posteriors" (needs matplotlib) draws the first cases' learned and exact posteriors.
"""
PROFILES = ("quick", "full")


def make_settings(profile):
    """The analysis settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    return {
        "analysis": "decay_study:DecayAnalysis",
        "inference": {"cases": 2000 if profile == "quick" else 10_000, "grid_points": 256, "levels": [0.68, 0.95]},
        "verification": {"max_model_evaluations": 1e10, "max_saved_bytes": 1e9, "max_candidate_points": 1e6},
        "metrics": ["classification", "coverage", "width", "bias", "agreement"],
        "plots": [],            # ["posteriors"] draws each run's first cases (needs matplotlib)
        "cohort_plots": [],
        "plotting": {"format": "png", "dpi": 120},
    }
