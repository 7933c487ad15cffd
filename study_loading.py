"""Loading a study: its classes from the settings, their members and sections checked, what the
plan says of them, and the report's layout (docs/extending.md, "The full contract").

The contract these check lives in study.py; nnpd.py, jobs.py and the kit call these before
anything is computed, so a study's mistake is one line at `plan`.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

import fingerprint
import trainer
from settings import ANALYSIS_SECTIONS, FORMAT_DOCS, TRAINING_SECTIONS, SettingsError, require
from store import EXPERIMENT_METHODS, LaunchError, import_class
from study import (
    ANALYSIS_MEMBERS,
    EXPERIMENT_SOURCES,
    Analysis,
    AnalysisContract,
    Experiment,
    ExperimentContract,
    Json,
    Member,
    Metric,
    Product,
    optional,
)

__all__ = [
    "load_class",
    "check_members",
    "check_study_sections",
    "plan_notes",
    "uses_bundled_trainer",
    "check_logit_shape",
    "load_study",
    "report_layout",
    "report_warnings",
    "experiment_sources",
    "metric_value",
    "module_folder",
    "json_value",
    "check_selection",
    "check_graph",
]


def load_class(spec: str, setting: str) -> type:
    """Import the experiment or analysis class named by a "module:Class" setting."""
    try:
        return import_class(spec, ())
    except ImportError as error:
        module = spec.partition(":")[0]
        # The folders a user put there (the settings folder among them), not the interpreter's own.
        folders = [path for path in sys.path if path and "site-packages" not in path and "/lib/python" not in path]
        raise SettingsError(
            f"{setting}: cannot import module {module!r} ({error}); nnpd looked in "
            f"{', '.join(folders)} and the installed packages: put {module}.py beside the "
            "settings files or add its folder to PYTHONPATH"
        ) from None
    except ValueError as error:
        raise SettingsError(f"{setting}: {error}") from None


def check_members(instance: object, spec: str, setting: str) -> None:
    """Every member the contract needs, as a class or an instance attribute."""
    members = EXPERIMENT_METHODS + EXPERIMENT_SOURCES if setting == "experiment" else ANALYSIS_MEMBERS
    missing = [name for name in members if not hasattr(instance, name)]
    if missing:
        base = "study.Experiment" if setting == "experiment" else "study.Analysis"
        raise SettingsError(
            f"{setting}: {spec!r} is not an nnpd {setting} class: it lacks {', '.join(missing)} "
            f'(subclass {base} for defaults; see docs/extending.md, "The full contract")'
        )


def check_study_sections(
    settings: dict[str, Any], framework: Sequence[str], study_class: type, contract: type, where: str
) -> None:
    """The settings' sections are the framework's plus exactly the study's own, when the study names them."""
    own = optional(study_class, "SECTIONS", contract)
    if own is None:
        return
    own_optional = tuple(optional(study_class, "OPTIONAL_SECTIONS", contract))
    missing = [name for name in (*framework, *own) if name not in settings]
    unknown = [str(name) for name in settings if name not in (*framework, *own, *own_optional)]
    if missing or unknown:
        found = ([f"missing sections: {', '.join(missing)}"] if missing else []) + (
            [f"unknown sections: {', '.join(unknown)}"] if unknown else []
        )
        allowed = ", ".join((*framework, *own)) + (f" (optional: {', '.join(own_optional)})" if own_optional else "")
        raise SettingsError(f"{where}: {'; '.join(found)}; {study_class.__name__} reads: {allowed} ({FORMAT_DOCS})")


def plan_notes(experiment: ExperimentContract, analysis: AnalysisContract) -> tuple[list[str], list[str]]:
    """A study's own lines at plan, from its optional plan_errors() and plan_warnings(): (lines that stop the
    analysis, warnings)."""
    errors = list(optional(analysis, "plan_errors", Analysis)())
    warnings = [*optional(experiment, "plan_warnings", Experiment)(), *optional(analysis, "plan_warnings", Analysis)()]
    return errors, warnings


def uses_bundled_trainer(experiment: ExperimentContract) -> bool:
    """Whether the experiment's train() is the default or calls the bundled trainer by name."""
    train = optional(type(experiment), "train", Experiment)
    if train is Experiment.train:
        return True
    if not inspect.isfunction(train):
        return False
    return any(
        train.__globals__.get(name) in (trainer, trainer.train) for name in fingerprint.referenced_names(train.__code__)
    )


def check_logit_shape(experiment: ExperimentContract, member: Member, spec: str) -> None:
    """The network returns one logit per row, (N,) or (N, 1): checked on two rows of zeros before any compute."""
    model = experiment.build_model(member)
    with torch.no_grad():
        logits = model(torch.zeros(2, int(experiment.input_size())))
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) not in ((2,), (2, 1)):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise SettingsError(
            f"model: {spec}'s network returns {shape} for 2 input rows; a ratio estimator returns "
            "one logit per row, shape (N,) or (N, 1)"
        )


def load_study(
    training_settings: dict[str, Any], analysis_settings: dict[str, Any]
) -> tuple[ExperimentContract, AnalysisContract]:
    """The experiment and analysis of one configuration, constructed and checked before any compute."""
    spec = training_settings["experiment"]
    experiment_class = load_class(spec, "experiment")
    check_study_sections(training_settings, TRAINING_SECTIONS, experiment_class, Experiment, "settings_training.py")
    experiment = experiment_class(training_settings)
    check_members(experiment, spec, "experiment")
    if uses_bundled_trainer(experiment):
        trainer.check_training_settings(
            experiment.training_settings()
            if isinstance(experiment, Experiment)
            else require(training_settings, "training", "settings_training.py")
        )
    experiment.validate()
    analysis_spec = analysis_settings["analysis"]
    analysis_class = load_class(analysis_spec, "analysis")
    # `metrics` and the figures may be left to the analysis class: every metric it defines unless it fills
    # its own default, and the figures it fills (none unless it does).
    check_study_sections(
        {"metrics": None, "plots": None, "cohort_plots": None, **analysis_settings},
        ANALYSIS_SECTIONS,
        analysis_class,
        Analysis,
        "settings_analysis.py",
    )
    analysis = analysis_class(analysis_settings, experiment)
    check_members(analysis, analysis_spec, "analysis")
    if optional(analysis, "settings", Analysis) is None:
        # An analysis class of its own that keeps no settings: the jobs read those nnpd constructed it with.
        analysis.settings = analysis_settings
    chosen = analysis.settings
    chosen.setdefault("metrics", list(analysis.metrics))
    for figures in ("plots", "cohort_plots"):  # the analysis class may choose default figures; else none
        chosen.setdefault(figures, [])
    check_graph(analysis.products, analysis.metrics, list(chosen["metrics"]))
    analysis.validate()
    return experiment, analysis


def report_layout(analysis_settings: dict[str, Any]) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The analysis class's report columns and comparison panels (`nnpd.py report`)."""
    analysis = load_class(analysis_settings["analysis"], "analysis")
    return (
        tuple(optional(analysis, "REPORT_COLUMNS", Analysis)),
        tuple(optional(analysis, "FIGURE_METRICS", Analysis)),
    )


def report_warnings(analysis_settings: dict[str, Any]) -> tuple[str, ...]:
    """The metric paths whose one-line warnings the report prints under its table (REPORT_WARNINGS)."""
    return tuple(optional(load_class(analysis_settings["analysis"], "analysis"), "REPORT_WARNINGS", Analysis))


def experiment_sources(experiment: ExperimentContract, which: str) -> tuple[object, ...]:
    """What enters the data ("DATA_SOURCES") or model ("MODEL_SOURCES") key: the study's class, the whole
    module of each of its classes (so no helper it calls is missed), and the code it names."""
    classes = [cls for cls in type(experiment).__mro__ if cls not in (object, Experiment)]
    modules = [sys.modules[cls.__module__] for cls in classes if cls.__module__ in sys.modules]
    unique = list(dict.fromkeys(modules))
    # The default train() is the bundled trainer's loop: its code, in trainer.py and the
    # modules split from it, shapes every model.
    trained = (trainer, *trainer.PARTS) if which == "MODEL_SOURCES" and uses_bundled_trainer(experiment) else ()
    return (type(experiment), *unique, *optional(experiment, which, Experiment), *trained)


def metric_value(name: str, value: Any) -> Json:
    """A metric's computed value made JSON (see json_value); a value JSON cannot hold is refused naming the metric."""
    try:
        return json_value(value, f"metric {name!r}")
    except ValueError as error:
        raise LaunchError(f"{error}; fix the metric's compute function (its products are kept)") from None


def module_folder(cls: type) -> str | None:
    """The folder of the file defining a class (run.json keeps it so restore can import the study), or None."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return str(Path(path).resolve().parent) if path else None


def json_value(value: Any, where: str) -> Json:
    """A metric's value as JSON: numpy scalars and arrays become numbers and lists; anything else is refused."""
    if isinstance(value, dict):
        return {str(key): json_value(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, np.ndarray):
        return json_value(value.tolist(), where)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(
        f"{where} is a {type(value).__name__}, which JSON cannot hold; return numbers, strings, "
        "lists and dicts (a tensor: .tolist())"
    )


def check_selection(section: str, selected: list[str], known: Sequence[str] | Mapping[str, Any]) -> None:
    """Every selected name exists and is listed once."""
    duplicates = sorted({name for name in selected if selected.count(name) > 1})
    if duplicates:
        raise SettingsError(f"{section}: listed more than once: {', '.join(duplicates)}")
    for name in selected:
        if name not in known:
            raise SettingsError(f"{section}: unknown name {name!r}; known: {', '.join(sorted(known)) or 'none'}")


def check_graph(products: Mapping[str, Product], metrics: Mapping[str, Metric], selected: list[str]) -> list[str]:
    """Reject unknown or duplicate metrics, unknown dependencies and cycles (plan time).

    Returns the products in an order that builds every dependency before its dependents.
    """
    check_selection("metrics", selected, metrics)
    for owner, needs in [(f"metric {m!r}", metrics[m].needs) for m in selected] + [
        (f"product {p!r}", spec.needs) for p, spec in products.items()
    ]:
        for need in needs:
            if need not in products:
                raise SettingsError(f"{owner} needs unknown product {need!r}")
    state: dict[str, str] = {}
    order: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "active":
            raise SettingsError(f"products form a cycle: {' -> '.join(path + [name])}")
        state[name] = "active"
        for need in products[name].needs:
            visit(need, path + [name])
        state[name] = "done"
        order.append(name)

    for name in products:
        visit(name, [])
    return order
