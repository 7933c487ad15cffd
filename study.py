"""The experiment/analysis contract: products, metrics and the context hooks receive.

An experiment class (named by `experiment` in the training settings) supplies the
cohort members, the training data, the network and its training. An analysis class
(named by `analysis`) supplies named products, built lazily through the store from
declared dependencies, and metrics computed from products. The protocols
`ExperimentContract` and `AnalysisContract` state what nnpd calls on each (and
`ProblemContract`, `PriorContract` what the kit's analysis reads of a problem and a prior);
the classes `Experiment` and `Analysis` give the optional members their one default, and
`optional` resolves a member a study's own class leaves out to that default. `load_study`
checks a study before anything is computed: its sections, its members, the bundled
trainer's settings when it trains with it, the product graph, and that its network returns
one logit per row. The study kit (nre_study.py) is one such study, written once for any
simulator.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

import fingerprint
import probes
import runtime
import trainer
from settings import ANALYSIS_SECTIONS, FORMAT_DOCS, TRAINING_SECTIONS, SettingsError, require
from store import EXPERIMENT_METHODS, Artifact, LaunchError, Store, Writer, import_class

__all__ = [
    "Product", "Metric", "Figure", "Context", "ProblemContract", "PROBLEM_OPTIONAL", "PriorContract",
    "PRIOR_OPTIONAL", "ExperimentContract", "AnalysisContract", "Experiment", "Analysis", "optional",
    "progress_to", "report_progress", "Progress",
    "load_class", "check_members", "check_study_sections", "plan_notes", "uses_bundled_trainer",
    "check_logit_shape", "load_study", "report_layout", "report_warnings", "experiment_sources", "metric_value",
    "module_folder", "json_value", "check_selection", "check_graph",
    "ANALYSIS_MEMBERS", "EXPERIMENT_SOURCES", "Member", "Json", "Reporter",
]

Member = dict[str, Any]          # one cohort member: a JSON dict with a unique, safe "name"
Json = Any                       # a value JSON can hold (dicts, lists, strings, numbers, None)


@dataclass(frozen=True)
class Product:
    """An analysis product: what it needs, what its key depends on, how it is built."""
    build: Callable[[Context, Writer], Json]      # writes the product's files, returns JSON metadata
    recipe: Callable[[Context], Json]             # the settings the product depends on
    needs: tuple[str, ...] = ()                   # names of the products it is built from
    uses_model: bool = False                      # whether the trained model enters its key


@dataclass(frozen=True)
class Metric:
    """A metric: the products it reads and how it turns them into small JSON values."""
    compute: Callable[[Context], Json]
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Figure:
    """A figure drawn into a matplotlib Figure the framework creates, saves and closes."""
    # draw(target, figure): target is a run's Context, or a list of the Contexts of a
    # configuration's cohort; figure is matplotlib's (Any: matplotlib is optional).
    draw: Callable[[Any, Any], None]


class ProblemContract(Protocol):
    """What the kit's analysis reads of `Experiment.problem()` (nre_study.Problem is one; docs/extending.md).

    The framework itself only hands the problem to the analysis (`ctx.problem`): a study
    with an analysis of its own may return anything, or None. The kit also reads two optional
    members where a problem has them (PROBLEM_OPTIONAL): `log_evidence(x, points, log_weights)`,
    an analytic evidence, and `posterior_sds(observations)`, rough posterior sds per parameter.
    """
    names: list[str]                              # the inferred parameters, p of them
    parameter_count: int                          # p, len(names)
    low: torch.Tensor                             # float64 (p,): the parameter box
    high: torch.Tensor
    grid_step: torch.Tensor | None                # (p,) lattice steps, None unless every parameter has one
    dimension: int                                # the numbers in one observation, d
    # simulate(theta (n, p), generator) -> x (n, d), every random number from `generator`;
    # None for a study trained on a bank alone.
    simulate: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None
    # The exact log p(x | θ), broadcasting x (..., d) against θ (..., p); None without one.
    log_likelihood: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None

    def parameter(self, name: str) -> dict[str, Any]:
        """The box and the bundled priors' hyper-parameters of one parameter (priors.PARAMETER_KEYS)."""
        ...

    def describe(self) -> Json:
        """A JSON description for run.json and the keys."""
        ...


PROBLEM_OPTIONAL = ("log_evidence", "posterior_sds")     # read with getattr, where a problem has them
PRIOR_OPTIONAL = ("support", "coordinate_log_prob", "problem")


class PriorContract(Protocol):
    """What the kit reads of `Experiment.prior(member)` (priors.Prior and priors.CustomPrior are two).

    The bundled families (priors.Prior) also give PRIOR_OPTIONAL, which the kit reads where a
    prior has them: `support(j)`, a lattice axis' points, `coordinate_log_prob(j, values)`, one
    coordinate's density for the figures, and `problem`, the problem it was made for.
    """
    lattice_steps: list[float | None]             # per parameter: its lattice step, or None when continuous

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n parameter rows, float64 (n, p), drawn from `generator`."""
        ...

    def log_prob(self, theta: torch.Tensor) -> torch.Tensor:
        """The log density (or lattice log mass) at theta (..., p): (...)."""
        ...

    def describe(self) -> Json:
        """A JSON description: it enters the keys and run.json."""
        ...


class ExperimentContract(Protocol):
    """What nnpd calls on every experiment (EXPERIMENT_METHODS and EXPERIMENT_SOURCES; docs/extending.md).

    Optional members, defaulted by `Experiment` and resolved by `optional`: SECTIONS,
    OPTIONAL_SECTIONS, plan_warnings(). restore's `r.posterior` calls `posterior(...)`
    where the experiment gives one (store.Restored: the store imports nothing of this module).
    """
    # Read-only (properties here): a class attribute of any sequence type, or a property, gives them.
    @property
    def DATA_SOURCES(self) -> Sequence[object]:
        """Code besides the study's module that shapes its data."""
        ...

    @property
    def MODEL_SOURCES(self) -> Sequence[object]:
        """Code besides the study's module that shapes its models."""
        ...

    def validate(self) -> None: ...
    def members(self) -> list[Member]: ...
    def problem(self, member: Member | None = None) -> ProblemContract: ...
    def prior(self, member: Member) -> PriorContract: ...
    def input_size(self) -> int: ...
    def data_recipe(self, member: Member) -> Json: ...
    def sample_data(self, member: Member) -> dict[str, np.ndarray]: ...
    def model_recipe(self, member: Member) -> Json: ...
    def build_model(self, member: Member) -> torch.nn.Module: ...
    def train(self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime,
              hooks: Any = None) -> tuple[dict[str, torch.Tensor], Any]: ...
    def workload(self, member: Member) -> dict[str, int]: ...
    def describe(self, member: Member) -> Json: ...


class AnalysisContract(Protocol):
    """What nnpd calls on every analysis (ANALYSIS_MEMBERS, and the settings it was constructed with).

    Optional members, defaulted by `Analysis` and resolved by `optional`: SECTIONS,
    OPTIONAL_SECTIONS, REPORT_COLUMNS, REPORT_WARNINGS, FIGURE_METRICS, WORKLOAD_ADVICE,
    plan_errors(), plan_warnings(); `settings` defaults to those nnpd constructed it with.
    """
    settings: dict[str, Any]

    # Read-only (properties here): class attributes give them, as the kit's analysis does.
    @property
    def products(self) -> Mapping[str, Product]:
        """Name -> product."""
        ...

    @property
    def metrics(self) -> Mapping[str, Metric]:
        """Name -> metric."""
        ...

    @property
    def plots(self) -> Mapping[str, Figure]:
        """Name -> a figure of one run."""
        ...

    @property
    def cohort_plots(self) -> Mapping[str, Figure]:
        """Name -> a figure of a configuration's cohort."""
        ...

    @property
    def SOURCES(self) -> Sequence[object]:
        """Code whose source enters every product's key."""
        ...

    def validate(self) -> None: ...
    def workload(self, member: Member) -> dict[str, int]: ...


class Experiment:
    """The training side of a study: what nnpd asks of it, with defaults for what a study may leave out.

    A study defines `members()`, `data_recipe(member)`, `sample_data(member)`,
    `model_recipe(member)`, `build_model(member)` and `input_size()` (ExperimentContract); the
    defaults below train with the bundled trainer on the `training` settings and describe nothing.
    Members may be class or instance attributes. nnpd constructs it with one
    configuration's resolved training settings. docs/extending.md describes each member.
    """

    DATA_SOURCES: Sequence[object] = ()           # code besides the study's own module that shapes its training data
    MODEL_SOURCES: Sequence[object] = ()          # ... and its models
    SECTIONS: Sequence[str] | None = None         # the study's own training-settings sections (None: any are allowed)
    OPTIONAL_SECTIONS: Sequence[str] = ()

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def validate(self) -> None:
        """Check the study's own sections; raise SettingsError naming the setting and the fix."""

    def problem(self, member: Member | None = None) -> Any:
        """The simulator's description, for the analysis (ctx.problem)."""
        return None

    def prior(self, member: Member) -> Any:
        """The member's prior, for the analysis (ctx.prior)."""
        return None

    def training_settings(self) -> dict[str, Any]:
        """The `training` settings the bundled trainer reads (a study may fill in defaults of its own)."""
        return require(self.settings, "training", "settings_training.py")

    def train(self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime,
              hooks: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
        """Train with the bundled trainer on the `training` settings; returns (CPU state dict, history)."""
        seed = runtime.derived_seed(self.settings["seed"], "train", member["name"])
        return trainer.train(model, data, self.training_settings(), rt, seed, hooks)

    def workload(self: ExperimentContract, member: Member) -> dict[str, int]:
        """The training cost estimate plan shows: examples seen and the network's size."""
        parameters = sum(p.numel() for p in self.build_model(member).parameters())
        return {"training_examples": 0, "network_parameters": int(parameters)}

    def describe(self, member: Member) -> Json:
        """A JSON description of the member for run.json."""
        return {}

    def plan_warnings(self) -> Sequence[str]:
        """Lines `plan` prints as warnings about the study (none)."""
        return ()


class Analysis:
    """The analysis side of a study: named products, metrics and figures, with defaults.

    nnpd constructs it as `Analysis(analysis_settings, experiment)`. docs/extending.md
    describes each member; `products` and `metrics` are what a study must give.
    """

    SOURCES: Sequence[object] = ()                # code whose source enters every product's key
    SECTIONS: Sequence[str] | None = None         # the study's own analysis-settings sections (None: any are allowed)
    OPTIONAL_SECTIONS: Sequence[str] = ()
    plots: dict[str, Figure] = {}
    cohort_plots: dict[str, Figure] = {}
    REPORT_COLUMNS: Sequence[tuple[str, str]] = ()    # (heading, metric path) pairs `nnpd.py report` tabulates
    # metric paths of one-line warnings (or notes, paths ending in "note") printed under the table
    REPORT_WARNINGS: Sequence[str] = ()
    FIGURE_METRICS: Sequence[tuple[str, str]] = ()    # (title, metric path) panels of `report --plot`
    WORKLOAD_ADVICE = "reduce the analysis"   # what to change when a limit is exceeded

    def __init__(self, settings: dict[str, Any], experiment: ExperimentContract) -> None:
        self.settings = settings
        self.experiment = experiment

    def validate(self) -> None:
        """Check the study's own analysis sections."""

    def workload(self, member: Member) -> dict[str, int]:
        """Model evaluations, saved bytes and candidate points of one member's analysis (plan's limits)."""
        return {"model_evaluations": 0, "saved_bytes": 0, "candidate_points": 0}

    def plan_errors(self) -> Sequence[str]:
        """Lines that stop `plan` before anything is computed (none)."""
        return ()

    def plan_warnings(self) -> Sequence[str]:
        """Lines `plan` prints as warnings about the analysis (none)."""
        return ()


ANALYSIS_MEMBERS = ("products", "metrics", "plots", "cohort_plots", "validate", "workload", "SOURCES")
EXPERIMENT_SOURCES = ("DATA_SOURCES", "MODEL_SOURCES")


def optional(part: object, name: str, contract: type) -> Any:
    """`part`'s member `name` (part an instance or a class), or the default of its contract's class, Experiment
    or Analysis: the one place the framework resolves an optional member a study's own class leaves out.

    None where the contract's class sets it only when constructed (an analysis' `settings`).
    """
    if hasattr(part, name):
        return getattr(part, name)
    default = getattr(contract, name, None)
    # A default method asked of an instance is bound to it, as if its class had inherited it.
    return types.MethodType(default, part) if inspect.isfunction(default) and not isinstance(part, type) else default


Reporter = Callable[[str, int, int], None]      # reporter(what, done, total)
_PROGRESS: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("nnpd_progress", default=None)


@contextlib.contextmanager
def progress_to(reporter: Reporter) -> Iterator[None]:
    """Within the block, report_progress calls reporter(what, done, total): nnpd's progress lines."""
    token = _PROGRESS.set(reporter)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def report_progress(what: str, done: int, total: int) -> None:
    """A study's progress through a long step (e.g. `sample_data` simulating a split in chunks): nnpd shows
    rows done, rate and time left in its log; outside nnpd's launches this does nothing."""
    reporter = _PROGRESS.get()
    if reporter is not None:
        reporter(what, done, total)


class Progress:
    """How far a long step is (a data split, an analysis product, a posterior): units done, rate, time left.

    On a terminal one line updates in place (at most twice a second); otherwise `emit` gets
    a plain line at each quarter, so logs stay short. Steps done within a couple of seconds
    show nothing.
    """

    QUIET_SECONDS = 2.0

    def __init__(self, emit: Callable[[str], None], prefix: str, unit: str = "cases") -> None:
        self.emit, self.prefix, self.unit = emit, prefix, unit
        self.started: dict[str, float] = {}
        self.shown: dict[str, int] = {}
        self.last = 0.0
        self.tty = sys.stdout.isatty()

    def __call__(self, what: str, done: int, total: int) -> None:
        """Show that `done` of `total` units of `what` are done."""
        now = time.monotonic()
        started = self.started.setdefault(what, now)
        quarter = 4 * done // max(total, 1)
        if (now - started < self.QUIET_SECONDS and what not in self.shown) \
                or (self.tty and now - self.last < 0.5 and done < total) \
                or (not self.tty and quarter <= self.shown.get(what, -1)):
            return
        self.shown[what], self.last = quarter, now
        rate = done / (now - started) if now > started and done else 0.0
        left = f", {(total - done) / rate:.0f} s left" if rate and done < total else ""
        line = f"{self.prefix}: {what} {done:,}/{total:,} {self.unit}, {rate:,.1f} {self.unit}/s{left}"
        if self.tty:
            end = "\n" if done >= total else ""
            print(f"\r[nnpd {time.strftime('%H:%M:%S')}] {line}\033[K", end=end, flush=True)
        else:
            self.emit(line)


def load_class(spec: str, setting: str) -> type:
    """Import the experiment or analysis class named by a "module:Class" setting."""
    try:
        return import_class(spec, ())
    except ImportError as error:
        module = spec.partition(":")[0]
        # The folders a user put there (the settings folder among them), not the interpreter's own.
        folders = [path for path in sys.path if path and "site-packages" not in path and "/lib/python" not in path]
        raise SettingsError(f"{setting}: cannot import module {module!r} ({error}); nnpd looked in "
                            f"{', '.join(folders)} and the installed packages: put {module}.py beside the "
                            "settings files or add its folder to PYTHONPATH") from None
    except ValueError as error:
        raise SettingsError(f"{setting}: {error}") from None


def check_members(instance: object, spec: str, setting: str) -> None:
    """Every member the contract needs, as a class or an instance attribute."""
    members = EXPERIMENT_METHODS + EXPERIMENT_SOURCES if setting == "experiment" else ANALYSIS_MEMBERS
    missing = [name for name in members if not hasattr(instance, name)]
    if missing:
        base = "study.Experiment" if setting == "experiment" else "study.Analysis"
        raise SettingsError(f"{setting}: {spec!r} is not an nnpd {setting} class: it lacks {', '.join(missing)} "
                            f"(subclass {base} for defaults; see docs/extending.md, \"The full contract\")")


def check_study_sections(settings: dict[str, Any], framework: Sequence[str], study_class: type, contract: type,
                         where: str) -> None:
    """The settings' sections are the framework's plus exactly the study's own, when the study names them."""
    own = optional(study_class, "SECTIONS", contract)
    if own is None:
        return
    own_optional = tuple(optional(study_class, "OPTIONAL_SECTIONS", contract))
    missing = [name for name in (*framework, *own) if name not in settings]
    unknown = [str(name) for name in settings if name not in (*framework, *own, *own_optional)]
    if missing or unknown:
        found = ([f"missing sections: {', '.join(missing)}"] if missing else []) + \
            ([f"unknown sections: {', '.join(unknown)}"] if unknown else [])
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
    return any(train.__globals__.get(name) in (trainer, trainer.train)
               for name in fingerprint.referenced_names(train.__code__))


def check_logit_shape(experiment: ExperimentContract, member: Member, spec: str) -> None:
    """The network returns one logit per row, (N,) or (N, 1): checked on two rows of zeros before any compute."""
    model = experiment.build_model(member)
    with torch.no_grad():
        logits = model(torch.zeros(2, int(experiment.input_size())))
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) not in ((2,), (2, 1)):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise SettingsError(f"model: {spec}'s network returns {shape} for 2 input rows; a ratio estimator returns "
                            "one logit per row, shape (N,) or (N, 1)")


def load_study(training_settings: dict[str, Any],
               analysis_settings: dict[str, Any]) -> tuple[ExperimentContract, AnalysisContract]:
    """The experiment and analysis of one configuration, constructed and checked before any compute."""
    spec = training_settings["experiment"]
    experiment_class = load_class(spec, "experiment")
    check_study_sections(training_settings, TRAINING_SECTIONS, experiment_class, Experiment, "settings_training.py")
    experiment = experiment_class(training_settings)
    check_members(experiment, spec, "experiment")
    if uses_bundled_trainer(experiment):
        trainer.check_training_settings(experiment.training_settings() if isinstance(experiment, Experiment)
                                        else require(training_settings, "training", "settings_training.py"))
    experiment.validate()
    analysis_spec = analysis_settings["analysis"]
    analysis_class = load_class(analysis_spec, "analysis")
    # `metrics` and the figures may be left to the analysis class: every metric it defines unless it fills
    # its own default, and the figures it fills (none unless it does).
    check_study_sections({"metrics": None, "plots": None, "cohort_plots": None, **analysis_settings},
                         ANALYSIS_SECTIONS, analysis_class, Analysis, "settings_analysis.py")
    analysis = analysis_class(analysis_settings, experiment)
    check_members(analysis, analysis_spec, "analysis")
    if optional(analysis, "settings", Analysis) is None:
        # An analysis class of its own that keeps no settings: the jobs read those nnpd constructed it with.
        analysis.settings = analysis_settings
    chosen = analysis.settings
    chosen.setdefault("metrics", list(analysis.metrics))
    for figures in ("plots", "cohort_plots"):       # the analysis class may choose default figures; else none
        chosen.setdefault(figures, [])
    check_graph(analysis.products, analysis.metrics, list(chosen["metrics"]))
    analysis.validate()
    return experiment, analysis


def report_layout(analysis_settings: dict[str, Any]) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The analysis class's report columns and comparison panels (`nnpd.py report`)."""
    analysis = load_class(analysis_settings["analysis"], "analysis")
    return (tuple(optional(analysis, "REPORT_COLUMNS", Analysis)),
            tuple(optional(analysis, "FIGURE_METRICS", Analysis)))


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
    raise ValueError(f"{where} is a {type(value).__name__}, which JSON cannot hold; return numbers, strings, "
                     "lists and dicts (a tensor: .tolist())")


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
    for owner, needs in [(f"metric {m!r}", metrics[m].needs) for m in selected] + \
                        [(f"product {p!r}", spec.needs) for p, spec in products.items()]:
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


@dataclass
class Context:
    """What a product, metric or plot hook gets for one trained model."""
    settings: dict[str, Any]      # resolved training settings of the configuration
    analysis_settings: dict[str, Any]
    member: Member
    experiment: ExperimentContract
    analysis: AnalysisContract
    runtime: runtime.Runtime
    run_dir: Path
    store: Store
    data: Artifact                # the training-data artifact
    model_artifact: Artifact
    used: dict[str, Artifact] = field(default_factory=dict)   # name -> Artifact this run used
    progress: Reporter | None = None           # progress(what, done, total) prints how far a product is
    _model: torch.nn.Module | None = None
    _problem: ProblemContract | None = None
    _prior: PriorContract | None = None

    @property
    def problem(self) -> ProblemContract:
        """The member's problem, built once."""
        if self._problem is None:
            self._problem = self.experiment.problem(self.member)
        return self._problem

    @property
    def prior(self) -> PriorContract:
        """The member's prior, built once."""
        if self._prior is None:
            self._prior = self.experiment.prior(self.member)
        return self._prior

    @property
    def model(self) -> torch.nn.Module:
        """The trained model on the runtime's device in eval mode, restored on first use."""
        if self._model is None:
            model = self.experiment.build_model(self.member)
            model.load_state_dict(self.model_artifact.state_dict())
            self._model = model.to(self.runtime.device).eval()
        return self._model

    def report_progress(self, what: str, done: int, total: int) -> None:
        """Tell the launch how many of a long product's cases are done (shown as progress)."""
        if self.progress is not None:
            self.progress(what, done, total)

    def generator(self, *labels: object) -> torch.Generator:
        """A named random stream derived from the settings' seed and the labels."""
        return runtime.seeded_generator(self.settings["seed"], *labels)

    def product_recipe(self, name: str) -> dict[str, Any]:
        """The full recipe of a product: settings, dependencies' keys, model, source, versions."""
        spec = self.analysis.products[name]
        recipe = {
            "settings": spec.recipe(self),
            "needs": {need: self.require(need).key for need in spec.needs},
            "source": fingerprint.source_fingerprint(spec.build, *self.analysis.SOURCES),
            "versions": fingerprint.library_versions(),
        }
        if spec.uses_model:
            recipe["model"] = self.model_artifact.key
        return recipe

    def require(self, name: str) -> Artifact:
        """The committed artifact of a product, built once through the store if missing.

        Timed as the phase product.<name>; its needs are required (and timed) before it.
        """
        if name in self.used:
            return self.used[name]
        spec = self.analysis.products[name]
        recipe = self.product_recipe(name)
        build = runtime.unless_stopped(lambda writer: spec.build(self, writer))
        with probes.phase(f"product.{name}"):
            artifact = self.store.get(name, recipe, build=build)
        self.used[name] = artifact
        return artifact
