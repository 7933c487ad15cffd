"""What is trained in the failing-simulator example (fragile_study.py): one small network.

python nnpd.py run --settings-dir examples/fragile
"""

DEFAULT_PROFILE = "quick"
PROFILES = ("quick",)


def make_settings(profile):
    """The quick profile: a few thousand simulations, invalid ones dropped, seconds on a CPU."""
    return {
        "experiment": "fragile_study:Fragile",
        "output": {"root": f"outputs/fragile-{profile}"},
        "seed": 1,
        "cohort": {"priors": ["lognormal"], "replicas": 1},
        "priors": {},
        "data": {"train": 6000, "validation": 500, "test": 500, "invalid": "drop"},
        "training": {"epochs": 20},
        "runtime": {"device": "cpu", "parallel": "jobs", "cpu_threads": 1},
    }
