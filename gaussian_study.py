"""The bundled study: how a neural ratio estimator depends on the prior it was trained under.

Its science is the Gaussian simulator of gaussian.py; the study kit (nre_study.py,
nre_analysis.py) supplies the cohort, the training pairs, the network, the training and
the whole analysis. README.md describes the study and its published numbers.
"""

import gaussian
import nre_study
from nre_analysis import NREAnalysis

__all__ = ["GaussianExperiment", "GaussianAnalysis"]


class GaussianExperiment(nre_study.Study):
    """One classifier per prior × replica on pairs from a diagonal Gaussian (the `problem` section)."""

    SECTIONS = ("problem", "cohort", "priors", "data", "model", "training")
    OPTIONAL_SECTIONS = ()
    DATA_SOURCES = nre_study.Study.DATA_SOURCES + (gaussian,)
    # The published numbers were measured on raw inputs (docs/results.md compares both).
    standardize = False

    @property
    def SCIENCE_SOURCES(self):
        """This module and the simulator's, whose code shapes the analysis' products."""
        return super().SCIENCE_SOURCES + (gaussian,)

    def make_problem(self):
        """The Gaussian problem of the `problem` section."""
        return gaussian.GaussianProblem.from_settings(self.settings["problem"])


class GaussianAnalysis(NREAnalysis):
    """The kit's analysis of the Gaussian study (the name its settings files use)."""
