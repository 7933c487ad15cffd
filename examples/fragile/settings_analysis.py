"""What is computed from the failing-simulator example's model: the kit's analysis on 256 truths.

Truths fill the whole box [0, 3], so a sixth of them fall where the simulator fails; with
data.invalid = "drop" (settings_training.py) the analysis drops those and counts them.
"""

PROFILES = ("quick",)


def make_settings(profile):
    """The quick profile's analysis: the kit's defaults, fewer truths."""
    return {"analysis": "nre_analysis:NREAnalysis", "inference": {"truths": {"sobol_truths": 256}}}
