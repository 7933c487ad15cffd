"""The experiment/analysis contract: plan-time graph checks, class loading, source fingerprints."""

import importlib
import itertools
import shutil
import subprocess
import sys

import pytest

import fingerprint
import store
import study
import study_loading
from helpers import REPO
from settings import SettingsError
from study import Metric, Product


def build(ctx, writer):
    """A product builder that is never called by these checks."""


def recipe(ctx):
    """An empty recipe."""
    return {}


def product(*needs):
    """A product needing the given products."""
    return Product(build, recipe, needs=needs)


@pytest.mark.unit
def test_a_sound_graph_passes_with_dependencies_first():
    products = {"c": product("a", "b"), "b": product("a"), "a": product(), "d": product()}
    assert study_loading.check_graph(products, {"m": Metric(len, needs=("c",))}, ["m"]) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    "products, metrics, selected, message",
    [
        ({"a": product()}, {"m": Metric(len)}, ["m", "nope"], "metrics: unknown name 'nope'"),
        ({"a": product()}, {"m": Metric(len)}, ["m", "m"], "more than once: m"),
        ({"a": product("ghost")}, {"m": Metric(len)}, ["m"], "needs unknown product 'ghost'"),
        ({"a": product()}, {"m": Metric(len, needs=("ghost",))}, ["m"], "metric 'm' needs unknown product"),
        ({"a": product("b"), "b": product("c"), "c": product("a")}, {}, [], "cycle: a -> b -> c -> a"),
        ({"a": product("a")}, {}, [], "cycle: a -> a"),
    ],
)
@pytest.mark.unit
def test_bad_graphs_are_rejected_at_plan_time(products, metrics, selected, message):
    with pytest.raises(SettingsError, match=message):
        study_loading.check_graph(products, metrics, selected)


@pytest.mark.unit
def test_load_class_names_the_setting_and_checks_the_contract():
    assert study_loading.load_class("gaussian_study:GaussianAnalysis", "analysis").__name__ == "GaussianAnalysis"
    with pytest.raises(SettingsError, match="experiment: cannot import module 'no_such_module'"):
        study_loading.load_class("no_such_module:X", "experiment")
    with pytest.raises(SettingsError, match="analysis: module 'study' has no class 'Nope'"):
        study_loading.load_class("study:Nope", "analysis")
    with pytest.raises(SettingsError, match="experiment: 'study:Product' is not an nnpd experiment class"):
        study_loading.check_members(
            study_loading.load_class("study:Product", "experiment")(None, None), "study:Product", "experiment"
        )
    with pytest.raises(SettingsError, match="standard-library module"):
        study_loading.load_class("subprocess:Popen", "experiment")


class OwnAnalysis:
    """An analysis class of a study's own that derives from nothing and gives one optional member."""

    REPORT_COLUMNS = (("AUC", "classification.auc"),)

    def plan_warnings(self):
        """One line of its own."""
        return ["own warning"]


@pytest.mark.unit
def test_an_optional_member_a_class_leaves_out_takes_the_contracts_one_default():
    own = OwnAnalysis()
    assert study.optional(own, "REPORT_COLUMNS", study.Analysis) == (("AUC", "classification.auc"),)
    assert study.optional(OwnAnalysis, "WORKLOAD_ADVICE", study.Analysis) == "reduce the analysis"
    assert study.optional(own, "plan_errors", study.Analysis)() == ()  # the default method, bound to it
    assert study.optional(own, "settings", study.Analysis) is None  # set by nnpd: no class default
    # plan reads both parts through it: the experiment's default and the analysis' own line.
    assert study_loading.plan_notes(object(), own) == ([], ["own warning"])


def protocol_members(protocol):
    """The names a Protocol class declares: its methods and annotated attributes."""
    declared = set(vars(protocol).get("__annotations__", {})) | {
        name for name, value in vars(protocol).items() if callable(value) or isinstance(value, property)
    }
    return {name for name in declared if not name.startswith("_")}


@pytest.mark.unit
def test_the_contract_protocols_declare_what_plan_requires_of_a_study():
    assert protocol_members(study.ExperimentContract) == set(store.EXPERIMENT_METHODS + study.EXPERIMENT_SOURCES)
    assert protocol_members(study.AnalysisContract) == set(study.ANALYSIS_MEMBERS) | {"settings"}


MODULE = """
def helper(value):
    return value + {helper_offset}


def builder(ctx, writer):
    return [helper(x) for x in range(3)]


def unrelated():
    return {unrelated_value}
"""


MODULE_NUMBERS = itertools.count(1)  # each written module a new name: imports are cached by name


def fingerprint_of(tmp_path, monkeypatch, helper_offset, unrelated_value):
    """The fingerprint of `builder` in a freshly written module."""
    name = f"fingerprint_module_{next(MODULE_NUMBERS)}"
    (tmp_path / f"{name}.py").write_text(MODULE.format(helper_offset=helper_offset, unrelated_value=unrelated_value))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    try:
        return fingerprint.source_fingerprint(module.builder)
    finally:
        del sys.modules[name]


@pytest.mark.unit
def test_fingerprint_follows_helpers_but_not_unrelated_code(tmp_path, monkeypatch):
    base = fingerprint_of(tmp_path, monkeypatch, 1, 1)
    assert fingerprint_of(tmp_path, monkeypatch, 1, 2) == base  # an unrelated function changed
    assert fingerprint_of(tmp_path, monkeypatch, 2, 1) != base  # a helper the builder calls changed


def learned_product_digest(framework):
    """The source part of the learned product's key, in a fresh interpreter importing the framework from
    the folder `framework`."""
    code = (
        f"import sys, types; sys.path.insert(0, {str(framework)!r}); import fingerprint, nre_analysis, study; "
        "problem = types.SimpleNamespace(parameter_count=1, log_likelihood=None); "
        "analysis = nre_analysis.NREAnalysis({}, types.SimpleNamespace(problem=lambda: problem)); "
        "print(fingerprint.source_fingerprint(nre_analysis.build_learned, *analysis.SOURCES))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return result.stdout.strip()


@pytest.mark.launch
def test_editing_the_adaptive_refinement_changes_the_analysis_products_keys(tmp_path):
    for path in REPO.glob("*.py"):
        shutil.copy(path, tmp_path)
    before = learned_product_digest(tmp_path)
    refinement = tmp_path / "adaptive.py"
    refinement.write_text(refinement.read_text().replace("REACH = 4.0", "REACH = 4.5"))
    assert learned_product_digest(tmp_path) != before
