"""Tests for settings.py: Choice, one-factor-at-a-time expansion, checks and profiles."""

import copy
import dataclasses
import json
import math
import random
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from settings import (
    LAUNCH_INVARIANT,
    Choice,
    Configuration,
    Profile,
    SettingsError,
    canonical_json,
    check_structure,
    digest,
    expand,
    identity,
    load_profile,
    resolve,
    to_jsonable,
)

# ---------------------------------------------------------------- helpers


def training_settings(**changes):
    """A small valid training settings dict, with sections replaced by changes."""
    base = {
        "experiment": "study:Experiment",
        "output": {"root": "outputs"},
        "seed": 1,
        "problem": {"dimension": 1},
        "cohort": {"priors": ["uniform"], "replicas": 1},
        "priors": {"uniform": {"low": -1.0, "high": 1.0}},
        "data": {"train": 64},
        "model": {"hidden": [32, 32]},
        "training": {"epochs": 1, "batch_size": 16},
        "runtime": {"device": "cpu"},
    }
    base.update(changes)
    return base


def analysis_settings(**changes):
    """A small valid analysis settings dict, with sections replaced by changes."""
    base = {
        "analysis": "study:Analysis",
        "inference": {"candidates": 16},
        "verification": {},
        "metrics": ["bias"],
        "plots": [],
        "cohort_plots": [],
        "plotting": {"dpi": 100},
    }
    base.update(changes)
    return base


def write_settings(folder, training_body, analysis_body, profiles=("smoke", "full"), default="smoke"):
    """Write both settings files; bodies are expressions of `profile`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings_training.py").write_text(
        textwrap.dedent(f"""\
        from settings import Choice
        DEFAULT_PROFILE = {default!r}
        PROFILES = {tuple(profiles)!r}
        def make_settings(profile):
            return {training_body}
        """)
    )
    (folder / "settings_analysis.py").write_text(
        textwrap.dedent(f"""\
        from sweep import Choice  # the name before the module was renamed still works
        PROFILES = {tuple(profiles)!r}
        def make_settings(profile):
            return {analysis_body}
        """)
    )
    return folder


def snapshot(folder):
    """Every path under folder with its size and mtime, to detect writes."""
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def get(settings, dotted):
    """Value at a dotted path."""
    node = settings
    for key in dotted.split("."):
        node = node[key]
    return node


def put(settings, dotted, value):
    """Copy of settings with the value at a dotted path replaced."""
    changed = copy.deepcopy(settings)
    keys = dotted.split(".")
    node = changed
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return changed


def choice_paths(value, path=""):
    """(dotted path, Choice) pairs in depth-first dict order (independent of settings.py)."""
    found = []
    if isinstance(value, Choice):
        return [(path, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            found += choice_paths(item, f"{path}.{key}" if path else key)
    return found


# ---------------------------------------------------------------- Choice and identity


@pytest.mark.unit
def test_choice_basics():
    c = Choice((1, 2, 3))
    assert c.options == [1, 2, 3]
    assert c == Choice([1, 2, 3]) and c != Choice([3, 2, 1])
    assert repr(c) == "Choice([1, 2, 3])"
    with pytest.raises(SettingsError, match="list or tuple"):
        Choice(5)


@pytest.mark.unit
def test_canonical_json_and_digest():
    assert canonical_json({"b": (1, 2), "a": 1.5}) == '{"a":1.5,"b":[1,2]}'
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest({"a": 1}) != digest({"a": 1.0})
    assert len(digest({})) == 64
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            canonical_json({"x": [bad]})


@pytest.mark.unit
def test_resolve_and_to_jsonable():
    s = {"a": Choice([{"x": 1}, {"x": 2}]), "b": (1, 2), "c": [Choice.__name__]}
    assert resolve(s) == {"a": {"x": 1}, "b": [1, 2], "c": ["Choice"]}
    assert to_jsonable(s)["a"] == {"choice": [{"x": 1}, {"x": 2}]}
    json.dumps(to_jsonable(s))  # printable as-is


# ---------------------------------------------------------------- exact expansions


@pytest.mark.unit
def test_two_choices_of_three_give_five():
    s = {"problem": {"dimension": Choice([1, 2, 3])}, "training": {"lr": Choice([0.1, 0.01, 0.001]), "epochs": 2}}
    configs = expand(s)
    assert [(c.knob, c.value) for c in configs] == [
        (None, None),
        ("problem.dimension", 2),
        ("problem.dimension", 3),
        ("training.lr", 0.01),
        ("training.lr", 0.001),
    ]
    assert [c.variant for c in configs] == [
        "baseline",
        "problem_dimension",
        "problem_dimension",
        "training_lr",
        "training_lr",
    ]
    assert configs[0].settings == {"problem": {"dimension": 1}, "training": {"lr": 0.1, "epochs": 2}}
    assert list(configs[0].settings["training"]) == ["lr", "epochs"]  # user's order
    assert configs[2].settings == {"problem": {"dimension": 3}, "training": {"lr": 0.1, "epochs": 2}}
    assert configs[4].settings["training"] == {"lr": 0.001, "epochs": 2}
    for c in configs:
        assert isinstance(c, Configuration)
        assert c.digest == identity(c.settings) == identity({**c.settings, "output": {"root": "elsewhere"}})
    assert [c.name.rsplit("-", 1)[0] for c in configs] == [
        "baseline",
        "problem_dimension=2",
        "problem_dimension=3",
        "training_lr=0.01",
        "training_lr=0.001",
    ]
    assert all(c.name.endswith(f"-{c.digest[:10]}") for c in configs)
    assert len({c.name for c in configs}) == 5


@pytest.mark.unit
def test_configuration_is_frozen():
    c = expand({"a": 1})[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.knob = "x"


@pytest.mark.unit
def test_option_equal_to_baseline_is_dropped():
    configs = expand({"a": Choice([1, 2, 1]), "b": Choice(["x", "x"])})
    assert [(c.knob, c.value) for c in configs] == [(None, None), ("a", 2)]


@pytest.mark.unit
def test_identical_settings_kept_once():
    # Within one knob: equal alternatives (also dicts) are kept once.
    s = {"m": Choice([{"w": 1}, {"w": 2}, {"w": 2}])}
    assert [(c.knob, c.value) for c in expand(s)] == [(None, None), ("m", {"w": 2})]
    # Across knobs: both alternatives give the baseline tree, so only it remains.
    assert [c.knob for c in expand({"a": Choice([1, 1]), "b": Choice([[2], (2,)])})] == [None]
    # Identity is canonical JSON: 1 and 1.0 differ, so 1.0 is a real alternative.
    s = {"x": Choice([1, 1.0, 1])}
    assert [(c.knob, c.value) for c in expand(s)] == [(None, None), ("x", 1.0)]


@pytest.mark.unit
def test_literal_list_is_one_value_and_options_are_atomic():
    assert len(expand({"model": {"hidden": [64, 64, 64, 64]}})) == 1
    s = {
        "model": {
            "hidden": Choice([[64] * 4, [128, 128]]),
            "opt": Choice([{"name": "adam", "lr": 1e-3}, {"name": "sgd"}]),
        }
    }
    configs = expand(s)
    assert [(c.knob, c.value) for c in configs] == [
        (None, None),
        ("model.hidden", [128, 128]),
        ("model.opt", {"name": "sgd"}),
    ]
    assert configs[0].settings["model"] == {"hidden": [64, 64, 64, 64], "opt": {"name": "adam", "lr": 1e-3}}
    # The dict option replaces the whole value; nothing of the baseline dict leaks in.
    assert configs[2].settings["model"]["opt"] == {"name": "sgd"}


@pytest.mark.unit
def test_expand_does_not_alias_user_input():
    option = [1, 2]
    s = {"a": Choice([[0], option])}
    configs = expand(s)
    configs[1].settings["a"].append(99)
    configs[1].value.append(98)
    assert option == [1, 2] and s["a"].options[1] == [1, 2]


# ---------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    "settings, path, words",
    [
        ({"m": {"w": Choice([{"x": Choice([1, 2])}])}}, "m.w[option 0].x", "nested"),
        ({"m": {"h": [1, Choice([1, 2])]}}, "m.h[1]", "plain list"),
        ({"m": {"h": Choice([])}}, "m.h", "empty Choice"),
        ({"m": {3: 1}}, "m", "not a string"),
        ({"m": {"": 1}}, "m", "empty key"),
        ({"m": {"a.b": 1}}, "m", "contains a dot"),
        ({"t": {"lr": math.nan}}, "t.lr", "finite"),
        ({"t": {"lr": [1.0, math.inf]}}, "t.lr[1]", "finite"),
        ({"t": {"lr": Choice([0.1, -math.inf])}}, "t.lr[option 1]", "finite"),
        ({"t": {"f": {1, 2}}}, "t.f", "not allowed"),
    ],
)
@pytest.mark.unit
def test_structure_rejections_name_the_path(settings, path, words):
    with pytest.raises(SettingsError) as info:
        check_structure(settings, where="here.py [p]")
    message = str(info.value)
    assert message.startswith(f"here.py [p] {path}: ")
    assert words in message
    with pytest.raises(SettingsError):
        expand(settings)


@pytest.mark.unit
def test_bad_key_at_top_level():
    with pytest.raises(SettingsError, match="<top level>: key 'a.b'"):
        check_structure({"a.b": 1})


# ---------------------------------------------------------------- profiles from files

TRAINING = (
    '{"experiment": "study:Experiment", "output": {"root": "outputs/" + profile},'
    ' "seed": 1, "problem": {"dimension": Choice([1, 2, 3]) if profile == "full"'
    ' else 1}, "cohort": {"priors": ["uniform"], "replicas": 1}, "priors": {},'
    ' "data": {"train": 64}, "model": {"hidden": [32, 32]},'
    ' "training": {"epochs": 1, "batch_size": 16}, "runtime": {"device": "cpu"}}'
)
ANALYSIS = (
    '{"analysis": "study:Analysis", "inference": {}, "verification": {},'
    ' "metrics": ["bias"], "plots": [], "cohort_plots": [], "plotting": {}}'
)


@pytest.mark.unit
def test_load_profile_from_files_elsewhere(tmp_path, monkeypatch):
    folder = write_settings(tmp_path / "elsewhere", TRAINING, ANALYSIS)
    before = snapshot(folder)
    monkeypatch.chdir(tmp_path)  # neither cwd nor settings dir holds settings.py
    modules_before = set(sys.modules)
    smoke = load_profile(folder)
    assert isinstance(smoke, Profile)
    assert smoke.name == "smoke" and smoke.settings_dir == folder
    assert smoke.training_path == folder / "settings_training.py"
    assert smoke.analysis_path == folder / "settings_analysis.py"
    assert smoke.training["output"] == {"root": "outputs/smoke"}
    assert smoke.analysis["metrics"] == ["bias"]
    assert len(smoke.configurations) == 1
    full = load_profile(str(folder), "full")
    assert isinstance(full.training["problem"]["dimension"], Choice)
    assert [c.value for c in full.configurations] == [None, 2, 3]
    assert [c.settings["problem"]["dimension"] for c in full.configurations] == [1, 2, 3]
    assert snapshot(folder) == before  # nothing written, no __pycache__
    assert not (folder / "__pycache__").exists()
    leaked = set(sys.modules) - modules_before
    assert "settings_training" not in leaked and "settings_analysis" not in leaked
    assert not any(name.startswith("_nnpd_settings") for name in leaked)


@pytest.mark.unit
def test_two_settings_dirs_do_not_collide(tmp_path):
    one = write_settings(tmp_path / "one", TRAINING, ANALYSIS)
    two = write_settings(tmp_path / "two", TRAINING.replace('"seed": 1', '"seed": 2'), ANALYSIS)
    assert load_profile(one).training["seed"] == 1
    assert load_profile(two).training["seed"] == 2
    assert load_profile(one).training["seed"] == 1


@pytest.mark.unit
def test_unknown_profile_lists_known_ones(tmp_path):
    folder = write_settings(tmp_path, TRAINING, ANALYSIS)
    with pytest.raises(SettingsError, match=r"unknown profile 'huge'.*smoke, full"):
        load_profile(folder, "huge")


@pytest.mark.unit
def test_missing_file_names_the_path(tmp_path):
    folder = write_settings(tmp_path, TRAINING, ANALYSIS)
    (folder / "settings_analysis.py").unlink()
    with pytest.raises(SettingsError) as info:
        load_profile(folder)
    assert str(folder / "settings_analysis.py") in str(info.value)


@pytest.mark.unit
def test_make_settings_error_is_reported(tmp_path):
    folder = write_settings(tmp_path, 'dict(a=1) if profile == "smoke" else 1 / 0', ANALYSIS)
    with pytest.raises(SettingsError, match=r"\[full\].*ZeroDivisionError"):
        load_profile(folder, "full")


@pytest.mark.unit
def test_missing_and_extra_sections(tmp_path):
    body = TRAINING.replace('"experiment": ', '"experimnt": ')
    folder = write_settings(tmp_path, body, ANALYSIS)
    with pytest.raises(SettingsError) as info:
        load_profile(folder)
    message = str(info.value)
    assert message.startswith("settings_training.py [smoke]")
    assert "missing sections: experiment" in message and "experimnt" not in message  # the study's are its own
    body = ANALYSIS.replace('"plots": [],', "")
    folder = write_settings(tmp_path / "b", TRAINING, body)
    assert "plots" not in load_profile(folder).analysis  # left to the analysis class (study_loading.load_study)
    body = ANALYSIS.replace('"analysis": ', '"analyss": ')
    folder = write_settings(tmp_path / "c", TRAINING, body)
    with pytest.raises(
        SettingsError,
        match=r"settings_analysis.py \[smoke\].*"
        "missing sections: analysis",
    ):
        load_profile(folder)


@pytest.mark.unit
def test_choice_in_analysis_rejected(tmp_path):
    body = ANALYSIS.replace('"inference": {}', '"inference": {"n": Choice([1, 2])}')
    folder = write_settings(tmp_path, TRAINING, body)
    with pytest.raises(SettingsError) as info:
        load_profile(folder)
    assert "settings_analysis.py [smoke] inference.n:" in str(info.value)
    assert "analysis is not swept" in str(info.value)


@pytest.mark.parametrize(
    "section, value, path",
    [
        ("experiment", Choice(["a:B", "c:D"]), "experiment"),
        ("output", {"root": Choice(["a", "b"])}, "output.root"),
        ("runtime", {"device": "cpu", "mode": Choice(["jobs", "ddp"])}, "runtime.mode"),
    ],
)
@pytest.mark.unit
def test_launch_invariant_sections(section, value, path):
    from settings import check_training

    assert section in LAUNCH_INVARIANT
    with pytest.raises(SettingsError) as info:
        check_training(training_settings(**{section: value}), "t.py [p]")
    assert f"t.py [p] {path}:" in str(info.value)
    assert "separate launches" in str(info.value)


@pytest.mark.unit
def test_class_reference_form():
    from settings import check_analysis, check_training

    with pytest.raises(SettingsError, match="experiment: 'study.Experiment'"):
        check_training(training_settings(experiment="study.Experiment"))
    with pytest.raises(SettingsError, match="analysis: 5"):
        check_analysis(analysis_settings(analysis=5))
    check_training(training_settings(model=Choice([{"h": [1]}, {"h": [2]}])))
    check_analysis(analysis_settings())


# ---------------------------------------------------------------- properties

keys = st.sampled_from(["a", "b", "c", "d", "e"])
leaves = st.one_of(
    st.integers(-3, 3), st.sampled_from(["x", "y"]), st.booleans(), st.none(), st.lists(st.integers(0, 2), max_size=3)
)
plain = st.recursive(leaves, lambda inner: st.dictionaries(keys, inner, max_size=3), max_leaves=6)
choice = st.lists(plain, min_size=1, max_size=4).map(Choice)
tree = st.recursive(
    st.one_of(leaves, choice, choice), lambda inner: st.dictionaries(keys, inner, min_size=1, max_size=4), max_leaves=10
).filter(lambda v: isinstance(v, dict))
FAST = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(tree)
@pytest.mark.property
def test_property_baseline_then_one_knob_each(settings):
    configs = expand(settings)
    knobs = choice_paths(settings)
    baseline = configs[0]
    assert baseline.knob is None and baseline.variant == "baseline"
    for path, c in knobs:
        assert get(baseline.settings, path) == resolve(c.options[0])
    order = [path for path, _ in knobs]
    positions = [order.index(c.knob) for c in configs[1:]]
    assert positions == sorted(positions)  # knobs appear in order of appearance
    for c in configs[1:]:
        assert get(c.settings, c.knob) == c.value
        assert canonical_json(get(c.settings, c.knob)) != canonical_json(get(baseline.settings, c.knob))
        restored = put(c.settings, c.knob, get(baseline.settings, c.knob))
        assert canonical_json(restored) == canonical_json(baseline.settings)


@FAST
@given(tree)
@pytest.mark.property
def test_property_count_matches_distinct_settings(settings):
    configs = expand(settings)
    baseline = resolve(settings)
    expected = {canonical_json(baseline)}
    for path, c in choice_paths(settings):
        for option in c.options[1:]:
            expected.add(canonical_json(put(baseline, path, option)))
    assert len(configs) == len(expected)
    assert len({c.digest for c in configs}) == len(configs)
    # With distinct options the count is exactly 1 + sum(options - 1).
    distinct = all(len({canonical_json(o) for o in c.options}) == len(c.options) for _, c in choice_paths(settings))
    if distinct:
        assert len(configs) == 1 + sum(len(c.options) - 1 for _, c in choice_paths(settings))


def shuffled(value, rng):
    """Same settings with every dict (also inside options) in a random order."""
    if isinstance(value, Choice):
        return Choice([shuffled(o, rng) for o in value.options])
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    return value


@FAST
@given(tree, st.integers(0, 2**31))
@pytest.mark.property
def test_property_digests_ignore_dict_order(settings, seed):
    other = shuffled(settings, random.Random(seed))
    a, b = expand(settings), expand(other)
    assert a[0].digest == b[0].digest
    assert {c.digest for c in a} == {c.digest for c in b}


# ---------------------------------------------------------------- a single-profile file and the defaults


def write_single(folder, training, analysis='{"analysis": "study:Analysis"}'):
    """Both settings files as single-profile SETTINGS dicts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings_training.py").write_text(f"from settings import Choice\nSETTINGS = {training}\n")
    (folder / "settings_analysis.py").write_text(f"SETTINGS = {analysis}\n")
    return folder


@pytest.mark.unit
def test_a_plain_dict_is_one_profile_named_after_its_folder_with_the_framework_defaults(tmp_path):
    folder = write_single(tmp_path / "my study", '{"experiment": "study:Experiment", "data": {"train": 64}}')
    loaded = load_profile(folder)
    assert loaded.name == "my_study"
    assert loaded.training["output"] == {"root": "outputs/my_study"}
    assert loaded.training["seed"] == 0 and loaded.training["runtime"] == {}
    assert load_profile(folder, "my_study").training == loaded.training
    spelled_out = write_single(
        tmp_path / "b",
        '{"experiment": "study:Experiment", "data": {"train": 64}, '
        '"seed": 0, "runtime": {}, "output": {"root": "elsewhere"}}',
    )
    assert identity(load_profile(spelled_out).training) == identity(loaded.training)  # filled as if written


@pytest.mark.unit
def test_a_plain_dict_may_sweep_and_serves_an_analysis_of_several_profiles(tmp_path):
    folder = write_single(tmp_path / "s", '{"experiment": "study:Experiment", "seed": Choice([1, 2])}')
    assert [c.settings["seed"] for c in load_profile(folder).configurations] == [1, 2]
    both = write_settings(tmp_path / "t", TRAINING, ANALYSIS)
    (both / "settings_analysis.py").write_text(f"SETTINGS = {ANALYSIS}\n")
    assert load_profile(both, "full").analysis["metrics"] == ["bias"]


@pytest.mark.parametrize(
    "training, profile, words",
    [
        ('{"experiment": "study:Experiment"}\nPROFILES = ("a",)', None, "defines both SETTINGS and PROFILES"),
        ("[1, 2]", None, "SETTINGS is a list; it must be a dict of sections"),
        ('{"experiment": "study:Experiment"}', "smoke", "holds one profile, 's' (SETTINGS, named after its folder)"),
        ('{"data": {}}', None, "missing sections: experiment"),
    ],
)
@pytest.mark.unit
def test_a_plain_dict_file_answers_mistakes_in_one_line_naming_the_docs(tmp_path, training, profile, words):
    folder = write_single(tmp_path / "s", training)
    with pytest.raises(SettingsError, match='README.md, "The settings files"') as info:
        load_profile(folder, profile)
    assert words in str(info.value)


@pytest.mark.unit
def test_a_file_with_neither_form_says_what_to_define(tmp_path):
    folder = write_single(tmp_path / "s", "{}")
    (folder / "settings_training.py").write_text("x = 1\n")
    with pytest.raises(SettingsError, match="defines neither SETTINGS .* nor PROFILES with make_settings"):
        load_profile(folder)


@pytest.mark.unit
def test_a_missing_setting_names_where_the_required_ones_are_listed():
    from settings import require

    with pytest.raises(
        SettingsError,
        match=r"^data\.validation is missing; add it to the settings \(README\.md, "
        r'"The settings files" says which a study needs\)$',
    ):
        require({"train": 64}, "validation", "data")
