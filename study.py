"""The experiment/analysis contract: products, metrics and the context hooks receive.

An experiment class (named by `experiment` in the training settings) supplies the
cohort members, the training data, the network and its training. An analysis class
(named by `analysis`) supplies named products, built lazily through the store from
declared dependencies, and metrics computed from products.
"""
import functools
import hashlib
import inspect
import linecache
import platform
import re
from dataclasses import dataclass, field

import numpy as np
import torch

import probes
import runtime
from settings import SettingsError
from store import EXPERIMENT_METHODS, import_class


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


# What an analysis class supplies (an experiment's methods are store.EXPERIMENT_METHODS, which restore checks),
# and the attributes naming the code that shapes their artifacts.
ANALYSIS_MEMBERS = ("products", "metrics", "plots", "cohort_plots", "validate", "workload", "SOURCES")
EXPERIMENT_SOURCES = ("DATA_SOURCES", "MODEL_SOURCES")


def load_class(spec, setting):
    """Import the experiment or analysis class named by a "module:Class" setting, checking its contract."""
    members = EXPERIMENT_METHODS + EXPERIMENT_SOURCES if setting == "experiment" else ANALYSIS_MEMBERS
    try:
        cls = import_class(spec, ())
    except ImportError as error:
        raise SettingsError(f"{setting}: cannot import module {spec.partition(':')[0]!r} ({error})") from None
    except ValueError as error:
        raise SettingsError(f"{setting}: {error}") from None
    missing = [name for name in members if not hasattr(cls, name)]
    if missing:
        raise SettingsError(f"{setting}: {spec!r} is not an nnpd {setting} class: it lacks {', '.join(missing)}")
    return cls


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
