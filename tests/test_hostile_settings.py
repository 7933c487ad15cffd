"""Malformed settings: every one ends in exit status 2 with one clear line, and nothing is written.

Hypothesis draws a setting of the bundled smoke profile (either file, whole sections too) and
a value it must refuse: of another kind, NaN or infinite, huge, or an unsafe name or path
(blank, a separator, '..', NUL, a line break, too long). Each case runs `nnpd run` in-process
on a settings folder of its own; the refusal is exit status 2 and one line naming the setting,
with nothing written. Missing required keys and hostile settings code are listed cases.
"""

import contextlib
import io
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import nnpd
import settings_analysis
import settings_training
from helpers import write_settings

# Hostile values, by the kind of the setting's smoke-profile value (the baseline).
NOT_FINITE = [math.nan, math.inf, -math.inf]
HUGE = st.one_of(
    st.floats(min_value=1e30, max_value=1e300),
    st.floats(min_value=-1e300, max_value=-1e30),
    st.integers(min_value=10**30, max_value=10**40),
    st.integers(min_value=-(10**40), max_value=-(10**30)),
)
BAD_NUMBER = st.one_of(st.sampled_from(NOT_FINITE), HUGE)
# Names and paths: blank, a NUL or a line break inside, a parent folder at the front, or longer than a file
# name may be; besides, names (but not output.root, a path) take no path separator.
UNSAFE_PATH = st.one_of(
    st.text(alphabet=" \t", max_size=3),
    st.builds("{}{}{}".format, st.text(max_size=6), st.sampled_from(["\x00", "\n"]), st.text(max_size=6)),
    st.builds("../{}".format, st.text(max_size=6)),
    st.text(alphabet=st.characters(blacklist_characters="/"), min_size=300, max_size=400),
)
UNSAFE_NAME = st.one_of(UNSAFE_PATH, st.builds("{}/{}".format, st.text(max_size=6), st.text(max_size=6)))
# Values of every JSON kind, each with one value of that kind; the kinds a setting does not hold are hostile to it.
KINDS = [
    (None, st.none()),
    (True, st.booleans()),
    (0, st.one_of(st.integers(-10, 10), st.floats(-10, 10))),
    ("a", st.text(alphabet="abcxyz", min_size=1, max_size=6)),
    ([], st.lists(st.integers(0, 3), max_size=2)),
    ({}, st.dictionaries(st.sampled_from(["zzz", "root"]), st.integers(0, 3), max_size=2)),
]


def leaves(value, path=()):
    """(path, value) of every entry below a dict, dicts included."""
    found = []
    for key, item in value.items():
        found.append((path + (key,), item))
        if isinstance(item, dict):
            found.extend(leaves(item, path + (key,)))
    return found


def same_kind(a, b):
    """Whether a value could stand where the baseline value stands (same JSON kind)."""
    kinds = [(bool,), (int, float), (str,), (list, tuple), (dict,), (type(None),)]
    return any(isinstance(a, kind) and isinstance(b, kind) for kind in kinds)


def hostile(path, baseline):
    """A strategy of values that the setting at `path`, whose smoke value is `baseline`, must refuse."""
    # A setting whose baseline is None ("no value") may take a number (training.gradient_clip).
    other_kinds = st.one_of(
        [
            strategy
            for example, strategy in KINDS
            if not same_kind(example, baseline) and not (baseline is None and isinstance(example, (int, float)))
        ]
    )
    if isinstance(baseline, (int, float)) and not isinstance(baseline, bool):
        return st.one_of(BAD_NUMBER, other_kinds)
    if isinstance(baseline, str):
        return st.one_of(UNSAFE_PATH if path == ("output", "root") else UNSAFE_NAME, other_kinds)
    if isinstance(baseline, list):
        return st.one_of(st.lists(st.one_of(BAD_NUMBER, UNSAFE_NAME), min_size=1, max_size=3), other_kinds)
    return other_kinds


SETTINGS = [
    (file, path, baseline)
    for file, module in (("training", settings_training), ("analysis", settings_analysis))
    for path, baseline in leaves(module.make_settings("smoke"))
]


@st.composite
def hostile_settings(draw):
    """(file, path, value): a setting of the smoke profile (either file, sections too) and a hostile value."""
    file, path, baseline = draw(st.sampled_from(SETTINGS))
    return file, path, draw(hostile(path, baseline))


def source(value):
    """Python source that evaluates to value (NaN and infinities included)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(source(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {source(item)}" for key, item in value.items()) + "}"
    return repr(value)


def patch(path, value):
    """The line that puts value at path inside make_settings."""
    return "settings" + "".join(f"[{key!r}]" for key in path) + f" = {source(value)}\n"


def run_in_process(arguments):
    """Run the command line here; return (status, stderr)."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
        status = nnpd.main(arguments)
    return status, captured.getvalue()


@contextlib.contextmanager
def inside(folder):
    """Work in folder (relative output roots land there, never in the repository)."""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def assert_refused(folder, file, code):
    """Write the patched settings, run them, and check the refusal."""
    training, analysis = (code, "") if file == "training" else ("", code)
    settings_dir = write_settings(folder / "s", folder / "out", training=training, analysis=analysis)
    before = sorted(folder.rglob("*"))
    with inside(folder):
        status, stderr = run_in_process(["run", "--settings-dir", str(settings_dir)])
    lines = stderr.strip().splitlines()
    assert status == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("nnpd: settings error:"), (code, stderr)
    assert "Traceback" not in stderr
    assert sorted(folder.rglob("*")) == before, code  # nothing written anywhere
    return lines[0]


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=hostile_settings())
@pytest.mark.property
def test_malformed_settings_are_refused_with_one_line(tmp_path_factory, case):
    file, path, value = case
    line = assert_refused(tmp_path_factory.mktemp("case"), file, patch(path, value))
    assert ".".join(path) in line, (value, line)  # the line names the setting


REQUIRED = [
    ("training", ("experiment",)),
    ("training", ("problem", "dimension")),
    ("training", ("data", "validation")),
    ("training", ("data", "train")),
    ("training", ("model", "kind")),
    ("training", ("problem",)),
    ("analysis", ("analysis",)),
]  # every other analysis setting has a default, as have output, seed,
# runtime and a kit study's cohort and priors (tests/test_settings.py)


@pytest.mark.parametrize("file, path", REQUIRED)
@pytest.mark.unit
def test_a_missing_required_setting_is_named(tmp_path, file, path):
    assert_refused(tmp_path, file, "del settings" + "".join(f"[{key!r}]" for key in path) + "\n")


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "raise RuntimeError('boom')\n",
        "settings['problem']['self'] = settings['problem']\n",
        "settings['seed'] = Path('x')\n",
    ],
)
@pytest.mark.unit
def test_settings_code_that_exits_raises_or_loops_is_a_settings_error(tmp_path, code):
    assert_refused(tmp_path, "training", "from pathlib import Path\n" + code)


@pytest.mark.parametrize(
    "path", [("training", "epochs"), ("runtime", "device"), ("runtime", "cpu_threads"), ("model", "dropout")]
)
@pytest.mark.unit
def test_a_deleted_setting_with_a_default_takes_it(tmp_path, path):
    settings_dir = write_settings(
        tmp_path / "s", tmp_path / "out", training="del settings" + "".join(f"[{key!r}]" for key in path) + "\n"
    )
    status, stderr = run_in_process(["plan", "--settings-dir", str(settings_dir)])
    assert status == 0, stderr
    assert not Path(tmp_path / "out").exists()
