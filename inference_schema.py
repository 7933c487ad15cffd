"""The study kit's `inference` settings: what each key may hold, the defaults a study may leave out,
and the check that fills them in (docs/extending.md tabulates every key).

The analysis (nre_analysis.py) and a posterior for one observation (posterior.py) both read the
section through check_inference_settings, so both see the same defaults.
"""

from __future__ import annotations

import copy
from typing import Any, TypedDict, cast

import designs
from settings import SettingsError, integer, is_number, name_list, one_of

__all__ = [
    "Truths",
    "Candidates",
    "Inference",
    "TARGETS",
    "INFERENCE_SCHEMA",
    "INFERENCE_DEFAULTS",
    "COARSE_PER_PARAMETER",
    "CANDIDATES_PER_PARAMETER",
    "default_design_sizes",
    "default_targets",
    "study_defaults",
    "check_inference_settings",
]

TARGETS = ("ratio", "posterior", "exact")


# The checked section as the code reads it: mypy names a key misspelt anywhere it is read.
class Truths(TypedDict):
    """Where the analysis' truths lie (inference.truths)."""

    kind: str
    truth_points_per_axis: int
    sobol_truths: int
    max_grid_truths: int
    truth_margin_fraction: float
    align_truths_to_grid: bool
    repeats: int


class Candidates(TypedDict):
    """The candidate design each case is scored on (inference.candidates)."""

    kind: str
    candidate_count: int
    candidate_points_per_axis: int
    native_grid_prior: bool
    max_enumerated: int
    coarse_count: int
    refinement_stages: int


class Inference(TypedDict):
    """The `inference` section, every default filled in (check_inference_settings)."""

    truths: Truths
    candidates: Candidates
    observations: int
    chunk_rows: int
    diagnostic_cases: int
    retain: str
    precision: str
    targets: list[str]
    levels: list[float]


INFERENCE_SCHEMA = {
    "truths": {
        "kind": ("grid", "sobol", "size_adaptive"),
        "truth_points_per_axis": int,
        "sobol_truths": int,
        "max_grid_truths": int,
        "truth_margin_fraction": float,
        "align_truths_to_grid": bool,
        "repeats": int,
    },
    "candidates": {
        "kind": designs.CANDIDATE_KINDS,
        "candidate_count": int,
        "candidate_points_per_axis": int,
        "native_grid_prior": bool,
        "max_enumerated": int,
        "coarse_count": int,
        "refinement_stages": int,
    },
    "observations": int,
    "chunk_rows": int,
    "diagnostic_cases": int,
    "retain": ("diagnostic", "full"),
    "precision": ("float32", "tf32", "bfloat16"),
    "targets": list,
    "levels": list,
}

# What a study's `inference` section may leave out (docs/extending.md tabulates every key). The None
# entries are each study's own (study_defaults): the candidate sizes from its parameter count, the
# targets from whether it gives an exact likelihood.
INFERENCE_DEFAULTS: dict[str, Any] = {
    "truths": {
        "kind": "sobol",
        "sobol_truths": 512,
        "truth_points_per_axis": 7,
        "max_grid_truths": 1024,
        "truth_margin_fraction": 0.0,
        "align_truths_to_grid": False,
        "repeats": 1,
    },
    "observations": 1,
    "candidates": {
        "kind": "adaptive",
        "candidate_count": None,
        "coarse_count": None,
        "refinement_stages": 3,
        "candidate_points_per_axis": 64,
        "native_grid_prior": True,
        "max_enumerated": 100_000,
    },
    "targets": None,
    "levels": [0.68, 0.95],
    "chunk_rows": 1 << 24,
    "precision": "float32",
    "retain": "diagnostic",
    "diagnostic_cases": 4,
}
# The default adaptive design per parameter: a coarse pass of 128 points and 1,024 in all, so the
# last refined pass keeps half the points. By the coarse-pass rule of plan's warning (README, "The
# bundled study") 128·p coarse points reach posteriors whose sd is above about 0.5% of the box's
# width at p = 1, 1.7% at p = 2, 4.7% at p = 6 and 6.2% at p = 10, at 1,024·p network rows a case.
COARSE_PER_PARAMETER = 128
CANDIDATES_PER_PARAMETER = 1024


# Counts beyond a billion (points, cases, rows) are surely typos.
MAX_COUNT = 10**9


def default_design_sizes(parameter_count):
    """The default adaptive design's sizes for p parameters (see COARSE_PER_PARAMETER)."""
    return {
        "candidate_count": CANDIDATES_PER_PARAMETER * parameter_count,
        "coarse_count": COARSE_PER_PARAMETER * parameter_count,
    }


def default_targets(likelihood):
    """Every target the study can score: the exact one only with an exact likelihood."""
    return ["ratio", "posterior"] + ["exact"] * bool(likelihood)


def with_defaults(given, defaults):
    """`given` with the keys it leaves out taken from `defaults`, one level of sections deep; a new dict.

    Only a missing key takes its default: a key given as None is checked (and refused) as given.
    """
    if not isinstance(given, dict):
        return given  # check_value names what is wrong with it
    filled = {key: copy.deepcopy(value) for key, value in defaults.items() if key not in given}
    for key, value in given.items():
        inner = defaults.get(key)
        filled[key] = (
            {**copy.deepcopy(inner), **value} if isinstance(inner, dict) and isinstance(value, dict) else value
        )
    return filled


def study_defaults(parameter_count, likelihood):
    """INFERENCE_DEFAULTS for one study: its None entries filled from the parameter count and the likelihood."""
    defaults = copy.deepcopy(INFERENCE_DEFAULTS)
    defaults["candidates"].update(default_design_sizes(parameter_count))
    defaults["targets"] = default_targets(likelihood)
    return defaults


def check_value(value, rule, path):
    """Check one setting against its rule: a type, a tuple of allowed values or a sub-schema."""
    if isinstance(rule, dict):
        if not isinstance(value, dict):
            raise SettingsError(f"{path}: expected a dict with keys {', '.join(rule)}")
        unknown = sorted(set(value) - set(rule))
        if unknown:
            raise SettingsError(f"{path}: unknown keys {unknown}; expected some of {', '.join(rule)}")
        for key, sub_rule in rule.items():
            check_value(value[key], sub_rule, f"{path}.{key}")
    elif isinstance(rule, tuple):
        one_of(value, rule, path)
    elif rule is int:
        integer(value, path, 0, MAX_COUNT)
    elif rule is float:
        if not is_number(value) or not 0 <= value < 0.5:
            raise SettingsError(f"{path}: expected a number in [0, 0.5), got {value!r}")
    elif not isinstance(value, rule):
        raise SettingsError(f"{path}: expected a {rule.__name__}, got {value!r}")


def check_inference_settings(settings: Any, parameter_count: int, likelihood: bool = True) -> Inference:
    """The `inference` section with every default filled in (INFERENCE_DEFAULTS), checked; returns a new dict.

    `parameter_count` sizes the default design; `likelihood` says whether the exact target is a default.
    """
    settings = with_defaults(settings, study_defaults(parameter_count, likelihood))
    check_value(settings, INFERENCE_SCHEMA, "inference")
    for key in ("observations", "chunk_rows"):
        if settings[key] < 1:
            raise SettingsError(f"inference.{key}: must be at least 1")
    for key in ("candidate_count", "coarse_count", "refinement_stages"):
        if settings["candidates"][key] < 1:
            raise SettingsError(f"inference.candidates.{key}: must be at least 1")
    targets = name_list(settings["targets"], "inference.targets", allow_empty=False)
    if not set(targets) <= set(TARGETS):
        raise SettingsError(
            f"inference.targets: a non-empty list of distinct targets from {', '.join(TARGETS)}; got {targets!r}"
        )
    levels = settings["levels"]
    if not levels or any(not is_number(v) or not 0 < v < 1 for v in levels) or sorted(set(levels)) != list(levels):
        raise SettingsError(f"inference.levels: increasing enclosed masses strictly between 0 and 1; got {levels!r}")
    return cast(Inference, settings)
