"""Analysis settings of the toy slope study (used by the tests)."""

PROFILES = ("toy",)


def make_settings(profile):
    """One profile."""
    return {
        "analysis": "toy_study:SlopeAnalysis",
        "inference": {"truth": 0.4},
        "verification": {"max_model_evaluations": 1e6, "max_saved_bytes": 1e6, "max_candidate_points": 1e4},
        "metrics": ["slope", "accuracy"],
        "plots": [],
        "cohort_plots": [],
        "plotting": {},
    }
