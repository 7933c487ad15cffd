"""What is trained in the decay-rate example (decay_study.py): one network per prior.

Two profiles: "quick" trains two small models on a CPU in seconds; "full" trains larger
ones on more data, three replicas per prior, and compares two network widths (a Choice:
the baseline, then one configuration with only `model.hidden` changed).

    python nnpd.py run --settings-dir examples/decay
"""

from settings import Choice

DEFAULT_PROFILE = "quick"
PROFILES = ("quick", "full")


def make_settings(profile):
    """The training settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    settings = {
        "experiment": "decay_study:Decay",
        "output": {"root": f"outputs/decay-{profile}"},
        "seed": 1896,
        # "uniform-rate" is the study's own prior object (Decay.custom_priors).
        "cohort": {"priors": ["log-uniform", "uniform-rate"], "replicas": 1},
        "priors": {"log-uniform": {"family": "uniform"}},
        "data": {"train": 8192, "validation": 1024, "test": 512},
        "model": {"kind": "mlp", "hidden": [32, 32], "activation": "relu"},
        "training": {"epochs": 8, "batch_size": 128, "learning_rate": 3e-3},
        "runtime": {"device": "auto", "parallel": "jobs", "cpu_threads": 1},
    }
    if profile == "full":
        settings["data"] = {"train": 200_000, "validation": 20_000, "test": 20_000}
        settings["model"]["hidden"] = Choice([[64, 64, 64], [128, 128, 128]])
        settings["training"].update(epochs=20, batch_size=256, learning_rate=1e-3)
        settings["cohort"]["replicas"] = 3
    return settings
