"""What is trained in the decay-rate example (examples/decay/decay_study.py).

Two profiles: "quick" trains two small models on a CPU in seconds; "full" trains larger
ones on more data and compares two network widths (a Choice: the baseline, then one
configuration with only `model.hidden` changed).

    PYTHONPATH=examples/decay python nnpd.py run --settings-dir examples/decay
"""
from settings import Choice

DEFAULT_PROFILE = "quick"
PROFILES = ("quick", "full")


def make_settings(profile):
    """The training settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    settings = {
        "experiment": "decay_study:DecayExperiment",
        "output": {"root": f"outputs/decay-{profile}"},
        "seed": 1896,
        # θ = log(rate); an observation is `waiting_times` intervals between decays.
        "problem": {"waiting_times": 8, "rate_low": 0.2, "rate_high": 5.0},
        "cohort": {"priors": ["log-uniform", "uniform"], "replicas": 1},
        "priors": {"log-uniform": {"family": "log-uniform"}, "uniform": {"family": "uniform"}},
        "data": {"train": 8192, "validation": 1024, "test": 2048},
        "model": {"hidden": [32, 32]},
        "training": {"epochs": 8, "batch_size": 128, "optimizer": "adam", "learning_rate": 3e-3,
                     "checkpoint": "best", "objective": "bce"},
        "runtime": {"device": "auto", "parallel": "jobs", "cpu_threads": 1, "deterministic": True,
                    "timeout_minutes": 60},
    }
    if profile == "full":
        settings["data"] = {"train": 200_000, "validation": 20_000, "test": 20_000}
        settings["model"]["hidden"] = Choice([[64, 64, 64], [128, 128, 128]])
        settings["training"].update(epochs=20, batch_size=256, learning_rate=1e-3)
        settings["cohort"]["replicas"] = 3
    return settings
