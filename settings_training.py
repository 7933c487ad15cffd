"""What is trained: the bundled Gaussian prior-dependence study, in three profiles.

Edit the dictionaries below. `Choice([...])` marks alternatives of one setting; a
launch trains the baseline (every Choice at its first option) and then one
configuration per further option with only that knob changed.
"""

from settings import Choice

__all__ = ["DEFAULT_PROFILE", "PROFILES", "base_settings", "make_settings"]

DEFAULT_PROFILE = "smoke"
PROFILES = ("smoke", "default", "paper")


def base_settings(profile):
    """Settings shared by every profile (the smoke study)."""
    return {
        "experiment": "gaussian_study:GaussianExperiment",
        "output": {"root": f"outputs/{profile}"},
        "seed": 20240611,
        "problem": {
            "dimension": 1,
            "infer": ["mean:*"],
            "fixed_mean": 5.0,
            "fixed_std": 2.0,
            "fixed": {},
            "parameters": {
                "mean": {
                    "low": 0.0,
                    "high": 10.0,
                    "normal_mean": 5.0,
                    "normal_std": 4.0,
                    "exponential_rate": 0.1,
                    "grid_step": 0.2,
                },
                "std": {
                    "low": 0.2,
                    "high": 4.0,
                    "normal_mean": 2.0,
                    "normal_std": 0.7,
                    "exponential_rate": 0.1,
                    "grid_step": 0.2,
                },
            },
            "overrides": {},
        },
        "cohort": {"priors": ["uniform", "normal", "exponential", "grid"], "replicas": 1},
        "priors": {
            "uniform": {"family": "uniform"},
            "normal": {"family": "normal"},
            "exponential": {"family": "exponential"},
            "grid": {"family": "grid"},
        },
        "data": {"train": 1024, "validation": 256, "test": 256},
        "model": {"kind": "mlp", "hidden": [32, 32], "activation": "relu", "dropout": 0.0},
        "training": {
            "epochs": 2,
            "batch_size": 128,
            "optimizer": "adam",
            "learning_rate": 1e-3,
            "betas": [0.9, 0.999],
            "epsilon": 1e-8,
            "weight_decay": 0.0,
            "gradient_clip": None,
            "precision": "off",
            "checkpoint": "best",
            # "bce", or "balanced": BCE plus balance_weight * (mean sigmoid over joint pairs
            # + mean sigmoid over product pairs - 1)^2 on each global batch.
            "objective": "bce",
            "balance_weight": 100.0,
        },
        "runtime": {
            "device": "auto",
            "parallel": "jobs",
            "cpu_threads": 1,
            "deterministic": True,
            "timeout_minutes": 60,
        },
    }


def make_settings(profile):
    """The training settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    settings = base_settings(profile)
    if profile == "smoke":
        return settings
    settings["problem"]["dimension"] = Choice([1, 2, 3, 4, 5, 6])
    settings["data"] = {"train": 70_000, "validation": 15_000, "test": 15_000}
    settings["model"]["hidden"] = [64, 64, 64, 64]
    settings["training"]["epochs"] = 5
    if profile == "paper":
        settings["problem"]["parameters"]["mean"]["exponential_rate"] = -0.1
    return settings
