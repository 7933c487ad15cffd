"""Malformed settings: every one ends in exit status 2 with one clear line, and nothing is written.

Values are generated per setting of the bundled smoke profile (both files): wrong types,
NaN and infinities, huge numbers, unsafe names (separators, '..', NUL, very long, unicode),
wrong nesting, missing required keys. Each case runs `nnpd run` in-process on a settings
folder of its own.
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

NUMBER_BREAKERS = [math.nan, math.inf, -math.inf, 1e30, -1e30, 10**30]
STRING_BREAKERS = ["", " ", "a/b", "../up", "x\x00y", "x" * 300, "a\nb"]
OTHER_BREAKERS = [None, [], {}, [[]], [{}], [None], {"zzz": 1}, "text", 0.5, True, -7]
# Settings that hold paths or free names accept some of the string breakers.
ACCEPTS = {("output", "root"): ["a/b", "text"], ("training", "gradient_clip"): [0.5]}


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


def breakers(baseline, path):
    """Values that no setting of this kind accepts."""
    found = [value for value in OTHER_BREAKERS
             if not same_kind(value, baseline) and value not in ACCEPTS.get(path, ())]
    if isinstance(baseline, (int, float)) and not isinstance(baseline, bool):
        found += NUMBER_BREAKERS
    if isinstance(baseline, str):
        found += [value for value in STRING_BREAKERS if value not in ACCEPTS.get(path, ())]
    if isinstance(baseline, list):
        found += [[value] for value in NUMBER_BREAKERS[:3]] + [["a/b"], [10**30]]
    return found


def cases():
    """(file, path, value) triples: every breaker of every setting of the smoke profile."""
    found = []
    for file, module in (("training", settings_training), ("analysis", settings_analysis)):
        for path, baseline in leaves(module.make_settings("smoke")):
            found += [(file, path, value) for value in breakers(baseline, path)]
    return found


CASES = cases()


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
    assert sorted(folder.rglob("*")) == before, code          # nothing written anywhere


@pytest.mark.slow
@hsettings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), number=st.integers(0, 10**9))
@pytest.mark.property
def test_malformed_settings_are_refused_with_one_line(tmp_path_factory, case, number):
    file, path, value = case
    folder = tmp_path_factory.mktemp(f"case{number % 1000}")
    assert_refused(folder, file, patch(path, value))


REQUIRED = [("training", ("experiment",)), ("training", ("problem", "dimension")), ("training", ("cohort", "priors")),
            ("training", ("data", "train")), ("training", ("model", "kind")), ("training", ("problem",)),
            ("analysis", ("analysis",))]      # every other analysis setting has a default


@pytest.mark.parametrize("file, path", REQUIRED)
@pytest.mark.unit
def test_a_missing_required_setting_is_named(tmp_path, file, path):
    assert_refused(tmp_path, file, "del settings" + "".join(f"[{key!r}]" for key in path) + "\n")


@pytest.mark.parametrize("code", [
    "import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "raise RuntimeError('boom')\n",
    "settings['problem']['self'] = settings['problem']\n", "settings['seed'] = Path('x')\n",
])
@pytest.mark.unit
def test_settings_code_that_exits_raises_or_loops_is_a_settings_error(tmp_path, code):
    assert_refused(tmp_path, "training", "from pathlib import Path\n" + code)


@pytest.mark.parametrize("path", [("training", "epochs"), ("runtime", "device"), ("runtime", "cpu_threads"),
                                  ("model", "dropout")])
@pytest.mark.unit
def test_a_deleted_setting_with_a_default_takes_it(tmp_path, path):
    settings_dir = write_settings(tmp_path / "s", tmp_path / "out",
                                  training="del settings" + "".join(f"[{key!r}]" for key in path) + "\n")
    status, stderr = run_in_process(["plan", "--settings-dir", str(settings_dir)])
    assert status == 0, stderr
    assert not Path(tmp_path / "out").exists()
