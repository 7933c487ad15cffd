"""What is computed from the decay-rate example's models: the kit's analysis (nre_analysis.py).

Truths fill the whole range of θ (Sobol points, no margin), one observation each, scored
on a grid of θ; "exact" repeats the analysis with the exact likelihood.
"""
PROFILES = ("quick", "full")


def make_settings(profile):
    """The analysis settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    return {
        "analysis": "nre_analysis:NREAnalysis",
        "inference": {
            "truths": {"kind": "sobol", "sobol_truths": 1000 if profile == "quick" else 10_000,
                       "truth_points_per_axis": 7, "max_grid_truths": 1024, "truth_margin_fraction": 0.0,
                       "align_truths_to_grid": False, "repeats": 1},
            "observations": 1,
            "candidates": {"kind": "grid", "candidate_count": 512, "candidate_points_per_axis": 512,
                           "native_grid_prior": True, "max_enumerated": 100_000, "coarse_count": 64,
                           "refinement_stages": 3},
            "targets": ["ratio", "posterior", "exact"],
            "levels": [0.68, 0.95],
            "chunk_rows": 1 << 24,      # at most this many rows per network call
            "retain": "diagnostic",
            "diagnostic_cases": 4,
        },
        "verification": {"max_model_evaluations": 1e10, "max_saved_bytes": 1e9, "max_candidate_points": 1e6},
        "metrics": ["classification", "bias", "coverage", "width", "resolution", "posterior", "exact_reference",
                    "expected_coverage", "pairwise", "reweighting", "normalization"],
        "plots": [],            # "diagnostic_cases", "expected_coverage" (need matplotlib)
        "cohort_plots": [],     # "priors", "training", "estimates", "bias_width"
        "plotting": {"format": "png", "dpi": 120},
    }
