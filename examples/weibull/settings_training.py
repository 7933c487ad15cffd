"""What is trained in the Weibull example (weibull_study.py): one small network per prior.

python nnpd.py run --settings-dir examples/weibull
"""

DEFAULT_PROFILE = "quick"
PROFILES = ("quick",)


def make_settings(profile):
    """The quick profile: a few thousand training pairs and a small MLP, seconds on a CPU."""
    return {
        "experiment": "weibull_study:Weibull",
        "output": {"root": f"outputs/weibull-{profile}"},
        "seed": 1951,
        "cohort": {"priors": ["uniform", "normal"], "replicas": 1},
        "priors": {"uniform": {"family": "uniform"}, "normal": {"family": "normal"}},
        "data": {"train": 16384, "validation": 2048, "test": 512},
        "model": {"kind": "mlp", "hidden": [64, 64], "activation": "relu"},
        "training": {"epochs": 12, "batch_size": 256, "learning_rate": 3e-3},
        "runtime": {"device": "auto", "parallel": "jobs", "cpu_threads": 1},
    }
