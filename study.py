"""The experiment/analysis contract: products, metrics and the context hooks receive.

An experiment class (named by `experiment` in the training settings) supplies the
cohort members, the training data, the network and its training. An analysis class
(named by `analysis`) supplies named products, built lazily through the store from
declared dependencies, and metrics computed from products. `Experiment` and `Analysis`
state what each must give and default the rest; `load_study` checks a study before
anything is computed: its sections, its members, the bundled trainer's settings when it
trains with it, the product graph, and that its network returns one logit per row.
The study kit (nre_study.py) is one such study, written once for any simulator.
"""
import contextlib
import contextvars
import functools
import hashlib
import inspect
import linecache
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import probes
import runtime
import trainer
from settings import ANALYSIS_SECTIONS, TRAINING_SECTIONS, SettingsError, require
from store import EXPERIMENT_METHODS, LaunchError, import_class


@dataclass(frozen=True)
class Product:
    """An analysis product: what it needs, what its key depends on, how it is built."""
    build: object                 # build(ctx, writer) -> JSON metadata
    recipe: object                # recipe(ctx) -> the settings the product depends on
    needs: tuple = ()             # names of the products it is built from
    uses_model: bool = False      # whether the trained model enters its key


@dataclass(frozen=True)
class Metric:
    """A metric: the products it reads and how it turns them into small JSON values."""
    compute: object               # compute(ctx) -> JSON value
    needs: tuple = ()


@dataclass(frozen=True)
class Figure:
    """A figure drawn into a matplotlib Figure the framework creates, saves and closes."""
    draw: object                  # draw(target, figure): target is a run's Context, or a list
                                  # of the Contexts of a configuration's cohort


class Experiment:
    """The training side of a study: what nnpd asks of it, with defaults for what a study may leave out.

    A study defines `members()`, `data_recipe(member)`, `sample_data(member)`,
    `model_recipe(member)`, `build_model(member)` and `input_size()`; the defaults below
    train with the bundled trainer on the `training` settings and describe nothing.
    Members may be class or instance attributes. nnpd constructs it with one
    configuration's resolved training settings. docs/extending.md describes each member.
    """

    DATA_SOURCES = ()          # code besides the study's own module that shapes its training data
    MODEL_SOURCES = ()         # ... and its models
    SECTIONS = None            # the study's own training-settings sections (None: any are allowed)
    OPTIONAL_SECTIONS = ()

    def __init__(self, settings):
        self.settings = settings

    def validate(self):
        """Check the study's own sections; raise SettingsError naming the setting and the fix."""

    def problem(self, member=None):
        """The simulator's description, for the analysis (ctx.problem)."""
        return None

    def prior(self, member):
        """The member's prior, for the analysis (ctx.prior)."""
        return None

    def training_settings(self):
        """The `training` settings the bundled trainer reads (a study may fill in defaults of its own)."""
        return require(self.settings, "training", "settings_training.py")

    def train(self, member, model, data, rt, hooks=None):
        """Train with the bundled trainer on the `training` settings; returns (CPU state dict, history)."""
        seed = runtime.derived_seed(self.settings["seed"], "train", member["name"])
        return trainer.train(model, data, self.training_settings(), rt, seed, hooks)

    def workload(self, member):
        """The training cost estimate plan shows: examples seen and the network's size."""
        parameters = sum(p.numel() for p in self.build_model(member).parameters())
        return {"training_examples": 0, "network_parameters": int(parameters)}

    def describe(self, member):
        """A JSON description of the member for run.json."""
        return {}


class Analysis:
    """The analysis side of a study: named products, metrics and figures, with defaults.

    nnpd constructs it as `Analysis(analysis_settings, experiment)`. docs/extending.md
    describes each member; `products` and `metrics` are what a study must give.
    """

    SOURCES = ()               # code whose source enters every product's key
    SECTIONS = None            # the study's own analysis-settings sections (None: any are allowed)
    OPTIONAL_SECTIONS = ()
    plots = {}
    cohort_plots = {}
    REPORT_COLUMNS = ()        # (heading, metric path) pairs `nnpd.py report` tabulates
    REPORT_WARNINGS = ()       # metric paths of one-line warnings (or notes, paths ending in "note") printed under the table
    FIGURE_METRICS = ()        # (title, metric path) panels of `report --plot`
    WORKLOAD_ADVICE = "reduce the analysis"   # what to change when a limit is exceeded

    def __init__(self, settings, experiment):
        self.settings = settings
        self.experiment = experiment

    def validate(self):
        """Check the study's own analysis sections."""

    def workload(self, member):
        """Model evaluations, saved bytes and candidate points of one member's analysis (plan's limits)."""
        return {"model_evaluations": 0, "saved_bytes": 0, "candidate_points": 0}


ANALYSIS_MEMBERS = ("products", "metrics", "plots", "cohort_plots", "validate", "workload", "SOURCES")
EXPERIMENT_SOURCES = ("DATA_SOURCES", "MODEL_SOURCES")


_PROGRESS = contextvars.ContextVar("nnpd_progress", default=None)


@contextlib.contextmanager
def progress_to(reporter):
    """Within the block, report_progress calls reporter(what, done, total): nnpd's progress lines."""
    token = _PROGRESS.set(reporter)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def report_progress(what, done, total):
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

    def __init__(self, emit, prefix, unit="cases"):
        self.emit, self.prefix, self.unit = emit, prefix, unit
        self.started, self.shown, self.last = {}, {}, 0.0
        self.tty = sys.stdout.isatty()

    def __call__(self, what, done, total):
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


def load_class(spec, setting):
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


def check_members(instance, spec, setting):
    """Every member the contract needs, as a class or an instance attribute."""
    members = EXPERIMENT_METHODS + EXPERIMENT_SOURCES if setting == "experiment" else ANALYSIS_MEMBERS
    missing = [name for name in members if not hasattr(instance, name)]
    if missing:
        base = "study.Experiment" if setting == "experiment" else "study.Analysis"
        raise SettingsError(f"{setting}: {spec!r} is not an nnpd {setting} class: it lacks {', '.join(missing)} "
                            f"(subclass {base} for defaults; see docs/extending.md)")


def check_study_sections(settings, framework, study_class, where):
    """The settings' sections are the framework's plus exactly the study's own, when the study names them."""
    own = getattr(study_class, "SECTIONS", None)
    if own is None:
        return
    optional = tuple(getattr(study_class, "OPTIONAL_SECTIONS", ()))
    missing = [name for name in (*framework, *own) if name not in settings]
    unknown = [str(name) for name in settings if name not in (*framework, *own, *optional)]
    if missing or unknown:
        found = ([f"missing sections: {', '.join(missing)}"] if missing else []) + \
            ([f"unknown sections: {', '.join(unknown)}"] if unknown else [])
        allowed = ", ".join((*framework, *own)) + (f" (optional: {', '.join(optional)})" if optional else "")
        raise SettingsError(f"{where}: {'; '.join(found)}; {study_class.__name__} reads: {allowed}")


def plan_notes(experiment, analysis):
    """A study's own lines at plan, from its optional plan_errors() and plan_warnings(): (lines that stop the
    analysis, warnings)."""
    def said(part, name):
        """The lines of a part's optional method."""
        return list(getattr(part, name)()) if hasattr(part, name) else []
    return said(analysis, "plan_errors"), said(experiment, "plan_warnings") + said(analysis, "plan_warnings")


def uses_bundled_trainer(experiment):
    """Whether the experiment's train() is the default or calls the bundled trainer by name."""
    train = getattr(type(experiment), "train", None)
    if train is Experiment.train:
        return True
    if not inspect.isfunction(train):
        return False
    return any(train.__globals__.get(name) in (trainer, trainer.train) for name in referenced_names(train.__code__))


def check_logit_shape(experiment, member, spec):
    """The network returns one logit per row, (N,) or (N, 1): checked on two rows of zeros before any compute."""
    model = experiment.build_model(member)
    with torch.no_grad():
        logits = model(torch.zeros(2, int(experiment.input_size())))
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) not in ((2,), (2, 1)):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise SettingsError(f"model: {spec}'s network returns {shape} for 2 input rows; a ratio estimator returns "
                            "one logit per row, shape (N,) or (N, 1)")


def load_study(training_settings, analysis_settings):
    """The experiment and analysis of one configuration, constructed and checked before any compute."""
    spec = training_settings["experiment"]
    experiment_class = load_class(spec, "experiment")
    check_study_sections(training_settings, TRAINING_SECTIONS, experiment_class, "settings_training.py")
    experiment = experiment_class(training_settings)
    check_members(experiment, spec, "experiment")
    if uses_bundled_trainer(experiment):
        trainer.check_training_settings(experiment.training_settings() if isinstance(experiment, Experiment)
                                        else require(training_settings, "training", "settings_training.py"))
    experiment.validate()
    analysis_spec = analysis_settings["analysis"]
    analysis_class = load_class(analysis_spec, "analysis")
    # `metrics` may be left to the analysis class: every metric it defines unless it fills its own default.
    check_study_sections({"metrics": None, **analysis_settings}, ANALYSIS_SECTIONS, analysis_class,
                         "settings_analysis.py")
    analysis = analysis_class(analysis_settings, experiment)
    check_members(analysis, analysis_spec, "analysis")
    if not hasattr(analysis, "settings"):
        # An analysis class of its own that keeps no settings: the jobs read those nnpd constructed it with.
        analysis.settings = analysis_settings
    chosen = analysis.settings
    chosen.setdefault("metrics", list(analysis.metrics))
    check_graph(analysis.products, analysis.metrics, list(chosen["metrics"]))
    analysis.validate()
    return experiment, analysis


def report_layout(analysis_settings):
    """The analysis class's report columns and comparison panels (`nnpd.py report`)."""
    analysis = load_class(analysis_settings["analysis"], "analysis")
    return tuple(getattr(analysis, "REPORT_COLUMNS", ())), tuple(getattr(analysis, "FIGURE_METRICS", ()))


def report_warnings(analysis_settings):
    """The metric paths whose one-line warnings the report prints under its table (REPORT_WARNINGS)."""
    return tuple(getattr(load_class(analysis_settings["analysis"], "analysis"), "REPORT_WARNINGS", ()))


def experiment_sources(experiment, which):
    """What enters the data ("DATA_SOURCES") or model ("MODEL_SOURCES") key: the study's class, the whole
    module of each of its classes (so no helper it calls is missed), and the code it names."""
    classes = [cls for cls in type(experiment).__mro__ if cls not in (object, Experiment)]
    modules = [sys.modules[cls.__module__] for cls in classes if cls.__module__ in sys.modules]
    unique = list(dict.fromkeys(modules))
    # The default train() is the bundled trainer's loop: its code, in trainer.py and the
    # modules split from it, shapes every model.
    trained = (trainer, *trainer.PARTS) if which == "MODEL_SOURCES" and uses_bundled_trainer(experiment) else ()
    return (type(experiment), *unique, *getattr(experiment, which), *trained)


def metric_value(name, value):
    """A metric's computed value made JSON (see json_value); a value JSON cannot hold is refused naming the metric."""
    try:
        return json_value(value, f"metric {name!r}")
    except ValueError as error:
        raise LaunchError(f"{error}; fix the metric's compute function (its products are kept)") from None


def module_folder(cls):
    """The folder of the file defining a class (run.json keeps it so restore can import the study), or None."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return str(Path(path).resolve().parent) if path else None


def json_value(value, where):
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


def check_selection(section, selected, known):
    """Every selected name exists and is listed once."""
    duplicates = sorted({name for name in selected if selected.count(name) > 1})
    if duplicates:
        raise SettingsError(f"{section}: listed more than once: {', '.join(duplicates)}")
    for name in selected:
        if name not in known:
            raise SettingsError(f"{section}: unknown name {name!r}; known: {', '.join(sorted(known)) or 'none'}")


def check_graph(products, metrics, selected):
    """Reject unknown or duplicate metrics, unknown dependencies and cycles (plan time).

    Returns the products in an order that builds every dependency before its dependents.
    """
    check_selection("metrics", selected, metrics)
    for owner, needs in [(f"metric {m!r}", metrics[m].needs) for m in selected] + \
                        [(f"product {p!r}", spec.needs) for p, spec in products.items()]:
        for need in needs:
            if need not in products:
                raise SettingsError(f"{owner} needs unknown product {need!r}")
    state, order = {}, []

    def visit(name, path):
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


def referenced_names(code):
    """Global names a code object and the functions nested in it refer to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names |= referenced_names(constant)
    return names


def source_objects(objects):
    """The given objects plus, for functions, the module-level functions they call, transitively."""
    found, pending = [], list(objects)
    while pending:
        obj = pending.pop(0)
        if any(obj is seen for seen in found):
            continue
        found.append(obj)
        if inspect.isfunction(obj):
            for name in sorted(referenced_names(obj.__code__)):
                helper = obj.__globals__.get(name)
                if inspect.isfunction(helper) and helper.__module__ == obj.__module__:
                    pending.append(helper)
    return found


@functools.cache
def source_fingerprint(*objects):
    """A digest of the source of the given modules, classes and functions and their helpers.

    A build function's own module-level helpers are followed, so editing the code that
    builds an artifact changes its key, while adding an unrelated metric does not.
    """
    hasher = hashlib.sha256()
    for obj in source_objects(objects):
        hasher.update(source_text(obj).encode())
    return hasher.hexdigest()


def source_text(obj):
    """inspect.getsource(obj), the same text, found without parsing a class's whole module.

    For a class, Python 3.11 and 3.12 parse its entire module (tens of milliseconds per
    launch); an undecorated top-level class is found by its one `class Name` line instead.
    """
    path = inspect.getsourcefile(obj) if inspect.isclass(obj) and "." not in obj.__qualname__ else None
    if path is None:
        return inspect.getsource(obj)
    linecache.checkcache(path)          # as inspect does: a file edited since it was read is read again
    block = class_block(obj, path, linecache.getlines(path))
    return "".join(block) if block is not None else inspect.getsource(obj)


def class_block(cls, path, lines):
    """The lines of a class's one undecorated `class Name` block in the file `path`, or None when unsure."""
    header = re.compile(rf"class\s+{re.escape(cls.__name__)}\b")
    starts = [index for index, line in enumerate(lines) if header.match(line)]
    if len(starts) != 1:
        return None
    start = starts[0]
    # The nearest line above that is neither blank nor a comment: a decorator, or a statement
    # the class line continues, makes the block unsure.
    above = [line.strip() for line in lines[:start] if line.strip() and not line.strip().startswith("#")]
    if above and (above[-1].startswith("@") or above[-1].endswith(("\\", ",", "(", "[", "{"))):
        return None
    block = inspect.getblock(lines[start:])
    codes = [inspect.unwrap(f).__code__ for f in vars(cls).values() if inspect.isfunction(f)]
    methods = [code.co_firstlineno for code in codes if code.co_filename == path]
    if any(not start + 1 < line <= start + len(block) for line in methods):
        return None                                 # the methods lie elsewhere: not this block
    return block


def library_versions():
    """The versions of Python, torch and numpy that enter every recipe."""
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}


@dataclass
class Context:
    """What a product, metric or plot hook gets for one trained model."""
    settings: dict                # resolved training settings of the configuration
    analysis_settings: dict
    member: dict
    experiment: object
    analysis: object
    runtime: object
    run_dir: object
    store: object
    data: object                  # the training-data artifact
    model_artifact: object
    used: dict = field(default_factory=dict)   # name -> Artifact this run used
    progress: object = None                    # progress(what, done, total) prints how far a product is
    _model: object = None
    _problem: object = None
    _prior: object = None

    @property
    def problem(self):
        """The member's problem, built once."""
        if self._problem is None:
            self._problem = self.experiment.problem(self.member)
        return self._problem

    @property
    def prior(self):
        """The member's prior, built once."""
        if self._prior is None:
            self._prior = self.experiment.prior(self.member)
        return self._prior

    @property
    def model(self):
        """The trained model on the runtime's device in eval mode, restored on first use."""
        if self._model is None:
            model = self.experiment.build_model(self.member)
            model.load_state_dict(self.model_artifact.state_dict())
            self._model = model.to(self.runtime.device).eval()
        return self._model

    def report_progress(self, what, done, total):
        """Tell the launch how many of a long product's cases are done (shown as progress)."""
        if self.progress is not None:
            self.progress(what, done, total)

    def generator(self, *labels):
        """A named random stream derived from the settings' seed and the labels."""
        return runtime.seeded_generator(self.settings["seed"], *labels)

    def product_recipe(self, name):
        """The full recipe of a product: settings, dependencies' keys, model, source, versions."""
        spec = self.analysis.products[name]
        recipe = {
            "settings": spec.recipe(self),
            "needs": {need: self.require(need).key for need in spec.needs},
            "source": source_fingerprint(spec.build, *self.analysis.SOURCES),
            "versions": library_versions(),
        }
        if spec.uses_model:
            recipe["model"] = self.model_artifact.key
        return recipe

    def require(self, name):
        """The committed artifact of a product, built once through the store if missing.

        Timed as the phase product.<name>; its needs are required (and timed) before it.
        """
        if name in self.used:
            return self.used[name]
        spec = self.analysis.products[name]
        recipe = self.product_recipe(name)
        with probes.phase(f"product.{name}"):
            artifact = self.store.get(name, recipe, build=lambda writer: spec.build(self, writer))
        self.used[name] = artifact
        return artifact
