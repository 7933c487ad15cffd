"""What is computed from the trained models: inference, metrics and figures.

Analysis is not swept: edit these settings and run `python nnpd.py analyze`; every
product and model already in the store is reused.
"""

__all__ = ["PROFILES", "make_settings"]

PROFILES = ("smoke", "default", "paper")

METRICS = [
    "classification",
    "bias",
    "coverage",
    "width",
    "resolution",
    "posterior",
    "exact_reference",
    "expected_coverage",
    "pairwise",
    "reweighting",
    "normalization",
]


def base_settings():
    """Settings shared by every profile (the smoke study)."""
    return {
        "analysis": "gaussian_study:GaussianAnalysis",
        "inference": {
            "truths": {
                "kind": "grid",
                "truth_points_per_axis": 7,
                "sobol_truths": 1024,
                "max_grid_truths": 1024,
                "truth_margin_fraction": 0.1,
                "align_truths_to_grid": True,
                "repeats": 1,
            },
            "observations": 15,
            "candidates": {
                "kind": "sobol",  # sobol or grid: one fixed design; adaptive: refined per case
                "candidate_count": 1024,  # sobol: the design's size; adaptive: points per case, all passes
                "candidate_points_per_axis": 64,
                "native_grid_prior": True,
                "max_enumerated": 200_000,
                "coarse_count": 64,  # adaptive: the shared first pass, and each intermediate pass
                "refinement_stages": 3,  # adaptive: refined passes per case and target
            },
            "targets": ["ratio", "posterior", "exact"],
            "levels": [0.68, 0.95],
            "chunk_rows": 1 << 24,  # at most this many rows per network call (see docs/devices.md)
            "precision": "float32",  # the analysis' network arithmetic on CUDA: float32, tf32 or bfloat16
            "retain": "diagnostic",
            "diagnostic_cases": 4,
        },
        "verification": {
            "max_model_evaluations": 2e12,
            "max_saved_bytes": 8e9,
            "max_candidate_points": 2e6,
        },
        "metrics": list(METRICS),
        "plots": [],  # per run: "diagnostic_cases", "expected_coverage", "rounds" (need matplotlib)
        "cohort_plots": [],  # per configuration: "priors", "training", "estimates", "bias_width"
        "plotting": {"format": "png", "dpi": 120},
    }


def make_settings(profile):
    """The analysis settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    settings = base_settings()
    inference = settings["inference"]
    if profile == "default":
        inference["truths"]["kind"] = "sobol"
        inference["candidates"].update(kind="adaptive", candidate_count=10_240, coarse_count=1024)
    elif profile == "paper":
        inference["truths"].update(
            kind="size_adaptive", truth_points_per_axis=25, truth_margin_fraction=0.0, align_truths_to_grid=False
        )
        inference["candidates"].update(candidate_count=16_384, native_grid_prior=False)
        inference["targets"] = ["ratio", "exact"]  # the posterior metric reports it is off
    return settings
