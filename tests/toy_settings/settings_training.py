"""Training settings of the toy slope study (used by the tests)."""

DEFAULT_PROFILE = "toy"
PROFILES = ("toy",)


def make_settings(profile):
    """One profile."""
    return {
        "experiment": "toy_study:SlopeExperiment",
        "output": {"root": "OUTPUT_ROOT"},
        "seed": 7,
        "problem": {"noise": 0.3},
        "cohort": {"replicas": 3},
        "priors": {"flat": {"low": -1, "high": 1}},
        "data": {"train": 2048, "validation": 256, "test": 256},
        "model": {"width": 16},
        "training": {
            "epochs": 6,
            "batch_size": 64,
            "optimizer": "adam",
            "learning_rate": 1e-2,
            "betas": [0.9, 0.999],
            "epsilon": 1e-8,
            "weight_decay": 0.0,
            "gradient_clip": None,
            "precision": "off",
            "checkpoint": "last",
        },
        "runtime": {"device": "cpu", "parallel": "jobs", "cpu_threads": 1, "deterministic": True, "timeout_minutes": 5},
    }
