"""What is trained in the pulse example (pulse_study.py): one network per prior, each a 1-D convolution
over the 200-point series (Pulse.embedding) in front of the classifier of the `model` section.

Two profiles: "quick" trains two small models on a CPU in seconds; "full" trains on more data
for longer, with the kit's patience.

    python nnpd.py run --settings-dir examples/pulse
"""

DEFAULT_PROFILE = "quick"
PROFILES = ("quick", "full")


def make_settings(profile):
    """The training settings of one profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(PROFILES)}")
    settings = {
        "experiment": "pulse_study:Pulse",
        "output": {"root": f"outputs/pulse-{profile}"},
        "seed": 1932,
        "cohort": {"priors": ["uniform", "normal"], "replicas": 1},
        "priors": {"uniform": {"family": "uniform"}, "normal": {"family": "normal"}},
        "data": {"train": 4096, "validation": 512, "test": 512},
        # The classifier behind the embedding: it reads the embedding's 8 features and (A, τ).
        "model": {"kind": "residual", "width": 32, "blocks": 1, "activation": "relu"},
        # The kit's contrastive recipe (nre_study.KIT_TRAINING) with these keys replaced.
        "training": {"epochs": 10, "batch_size": 128, "learning_rate": 3e-3},
        "runtime": {"device": "auto", "parallel": "jobs", "cpu_threads": 1},
    }
    if profile == "full":
        settings["data"] = {"train": 100_000, "validation": 10_000, "test": 10_000}
        settings["model"]["width"] = 64
        settings["training"].update(epochs=200, batch_size=256, learning_rate=1e-3)
    return settings
