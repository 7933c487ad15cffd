"""The experiment/analysis contract: products, metrics and the context hooks receive.

An experiment class (named by `experiment` in the training settings) supplies the
cohort members, the training data, the network and its training. An analysis class
(named by `analysis`) supplies named products, built lazily through the store from
declared dependencies, and metrics computed from products. The protocols
`ExperimentContract` and `AnalysisContract` state what nnpd calls on each (and
`ProblemContract`, `PriorContract` what the kit's analysis reads of a problem and a prior);
the classes `Experiment` and `Analysis` give the optional members their one default, and
`optional` resolves a member a study's own class leaves out to that default.
`study_loading.load_study` checks a study before anything is computed: its sections, its members, the bundled
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
from settings import require
from store import Artifact, Store, Writer

__all__ = [
    "Product",
    "Metric",
    "Figure",
    "Context",
    "ProblemContract",
    "PROBLEM_OPTIONAL",
    "PriorContract",
    "PRIOR_OPTIONAL",
    "ExperimentContract",
    "AnalysisContract",
    "Experiment",
    "Analysis",
    "optional",
    "progress_to",
    "report_progress",
    "Progress",
    "ANALYSIS_MEMBERS",
    "EXPERIMENT_SOURCES",
    "Member",
    "Json",
    "Reporter",
]

Member = dict[str, Any]  # one cohort member: a JSON dict with a unique, safe "name"
Json = Any  # a value JSON can hold (dicts, lists, strings, numbers, None)


@dataclass(frozen=True)
class Product:
    """An analysis product: what it needs, what its key depends on, how it is built."""

    build: Callable[[Context, Writer], Json]  # writes the product's files, returns JSON metadata
    recipe: Callable[[Context], Json]  # the settings the product depends on
    needs: tuple[str, ...] = ()  # names of the products it is built from
    uses_model: bool = False  # whether the trained model enters its key


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

    names: list[str]  # the inferred parameters, p of them
    parameter_count: int  # p, len(names)
    low: torch.Tensor  # float64 (p,): the parameter box
    high: torch.Tensor
    grid_step: torch.Tensor | None  # (p,) lattice steps, None unless every parameter has one
    dimension: int  # the numbers in one observation, d
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


PROBLEM_OPTIONAL = ("log_evidence", "posterior_sds")  # read with getattr, where a problem has them
PRIOR_OPTIONAL = ("support", "coordinate_log_prob", "problem")


class PriorContract(Protocol):
    """What the kit reads of `Experiment.prior(member)` (priors.Prior and priors.CustomPrior are two).

    The bundled families (priors.Prior) also give PRIOR_OPTIONAL, which the kit reads where a
    prior has them: `support(j)`, a lattice axis' points, `coordinate_log_prob(j, values)`, one
    coordinate's density for the figures, and `problem`, the problem it was made for.
    """

    lattice_steps: list[float | None]  # per parameter: its lattice step, or None when continuous

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
    OPTIONAL_SECTIONS, plan_warnings(), file_digests(). restore's `r.posterior` calls `posterior(...)`
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
    def train(
        self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime, hooks: Any = None
    ) -> tuple[dict[str, torch.Tensor], Any]: ...
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

    DATA_SOURCES: Sequence[object] = ()  # code besides the study's own module that shapes its training data
    MODEL_SOURCES: Sequence[object] = ()  # ... and its models
    SECTIONS: Sequence[str] | None = None  # the study's own training-settings sections (None: any are allowed)
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

    def train(
        self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime, hooks: Any = None
    ) -> tuple[dict[str, torch.Tensor], Any]:
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

    def file_digests(self) -> dict[str, str]:
        """Setting -> content digest of each file the settings name as data (none): they join the training's
        identity, its run folders' names and its slot in history.json, so an overwritten file is another training."""
        return {}

    def plan_warnings(self) -> Sequence[str]:
        """Lines `plan` prints as warnings about the study (none)."""
        return ()


class Analysis:
    """The analysis side of a study: named products, metrics and figures, with defaults.

    nnpd constructs it as `Analysis(analysis_settings, experiment)`. docs/extending.md
    describes each member; `products` and `metrics` are what a study must give.
    """

    SOURCES: Sequence[object] = ()  # code whose source enters every product's key
    SECTIONS: Sequence[str] | None = None  # the study's own analysis-settings sections (None: any are allowed)
    OPTIONAL_SECTIONS: Sequence[str] = ()
    plots: dict[str, Figure] = {}
    cohort_plots: dict[str, Figure] = {}
    REPORT_COLUMNS: Sequence[tuple[str, str]] = ()  # (heading, metric path) pairs `nnpd.py report` tabulates
    # metric paths of one-line warnings (or notes, paths ending in "note") printed under the table
    REPORT_WARNINGS: Sequence[str] = ()
    FIGURE_METRICS: Sequence[tuple[str, str]] = ()  # (title, metric path) panels of `report --plot`
    WORKLOAD_ADVICE = "reduce the analysis"  # what to change when a limit is exceeded

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


Reporter = Callable[[str, int, int], None]  # reporter(what, done, total)
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
        if (
            (now - started < self.QUIET_SECONDS and what not in self.shown)
            or (self.tty and now - self.last < 0.5 and done < total)
            or (not self.tty and quarter <= self.shown.get(what, -1))
        ):
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


@dataclass
class Context:
    """What a product, metric or plot hook gets for one trained model."""

    settings: dict[str, Any]  # resolved training settings of the configuration
    analysis_settings: dict[str, Any]
    member: Member
    experiment: ExperimentContract
    analysis: AnalysisContract
    runtime: runtime.Runtime
    run_dir: Path
    store: Store
    data: Artifact  # the training-data artifact
    model_artifact: Artifact
    used: dict[str, Artifact] = field(default_factory=dict)  # name -> Artifact this run used
    progress: Reporter | None = None  # progress(what, done, total) prints how far a product is
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
