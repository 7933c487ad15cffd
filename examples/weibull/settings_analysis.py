"""What is computed from the Weibull example's models: the kit's whole analysis (docs/extending.md).

Each truth gets `observations` simulated observations, scored on a fixed Sobol design of
candidates; the "exact" target repeats the analysis with the exact likelihood.
"""
PROFILES = ("quick",)


def make_settings(profile):
    """The quick profile's analysis."""
    return {
        "analysis": "nre_analysis:NREAnalysis",
        "inference": {
            # 512 x 2 (two parameters) Sobol truths over the whole box, no margin: exact coverage is nominal.
            "truths": {"kind": "sobol", "sobol_truths": 512, "truth_points_per_axis": 7, "max_grid_truths": 1024,
                       "truth_margin_fraction": 0.0, "align_truths_to_grid": False, "repeats": 1},
            "observations": 1,      # one observation (six lifetimes) per truth
            "candidates": {"kind": "sobol", "candidate_count": 2048, "candidate_points_per_axis": 32,
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
