"""Shared fixtures: tiny settings files written into a temporary directory."""
import concurrent.futures
import contextlib
import functools
import io
import os
import subprocess
import sys
import textwrap
import traceback
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TINY_TRAINING = """
    settings["data"] = {"train": 256, "validation": 64, "test": 64}
    settings["model"]["hidden"] = [16]
    settings["training"]["epochs"] = 2
    settings["training"]["batch_size"] = 64
    settings["runtime"]["device"] = "cpu"
"""
TINY_ANALYSIS = """
    settings["inference"]["truths"]["truth_points_per_axis"] = 4
    settings["inference"]["candidates"]["candidate_count"] = 64
    settings["inference"]["observations"] = 5
"""


def write_settings(directory, root, training="", analysis="", tiny=True):
    """Copy the repository's settings files into `directory`, patched by the given code.

    The patch code runs inside make_settings with `settings` and `profile` in scope.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, patch, tiny_patch in (("settings_training.py", training, TINY_TRAINING),
                                    ("settings_analysis.py", analysis, TINY_ANALYSIS)):
        body = textwrap.dedent(tiny_patch if tiny else "")
        if name == "settings_training.py":
            body += f'settings["output"]["root"] = {str(root)!r}\n'
        body += textwrap.dedent(patch)
        source = (REPO / name).read_text()
        source += "\n\n_repository_make_settings = make_settings\n\n\ndef make_settings(profile):\n"
        source += "    settings = _repository_make_settings(profile)\n"
        source += textwrap.indent(body, "    ") + "    return settings\n"
        (directory / name).write_text(source)
    return directory


@pytest.fixture
def study_dir(tmp_path):
    """A settings directory with tiny smoke settings writing to tmp_path/out."""
    return write_settings(tmp_path / "settings", tmp_path / "out")


@pytest.fixture(scope="session")
def trained_smoke_root(tmp_path_factory):
    """An output root that `run` of the tiny smoke settings (study_dir's) made: for tests to copy, never to change.

    Shared by the modules that each would train the same root (tests/test_root.py, tests/test_root_guards.py).
    """
    tmp = tmp_path_factory.mktemp("trained")
    result = run_cli("run", "--settings-dir", str(write_settings(tmp / "s", tmp / "out")))
    assert result.returncode == 0, result.stderr
    return tmp / "out"


def run_cli(*args, cwd=None, env=None, timeout=600):
    """Run `python nnpd.py ...` in a subprocess and return the completed process."""
    environment = {**os.environ, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    return subprocess.run([sys.executable, str(REPO / "nnpd.py"), *args], cwd=cwd or REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def main_in_process(*args, cwd=None, env=None):
    """`nnpd.main(args)` in this process, answered as run_cli's launch would be: a CompletedProcess with the
    exit status and what was printed to stdout and stderr.

    For the checks of what the command line answers that do not depend on a fresh process (no signals,
    locks, launchers or environment of its own); each concern of that kind keeps a real launch elsewhere.
    As in a fresh interpreter, warnings are shown (once per place) rather than recorded by pytest, and an
    exception nnpd lets escape is a traceback on stderr with exit status 1.
    """
    import nnpd

    stdout, stderr = io.StringIO(), io.StringIO()
    with _launch_state(cwd, env), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        warnings.resetwarnings()                        # a fresh interpreter's filters and display
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show_on_stderr         # not into pytest's record of the test's warnings
        try:
            status = nnpd.main(list(args))
        except SystemExit as stop:                      # argparse's usage errors
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except Exception:                               # what would end a launch with a traceback
            traceback.print_exc()
            status = 1
    return subprocess.CompletedProcess(["nnpd", *args], status, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _launch_state(cwd, env):
    """In `cwd` (the repository by default) with `env` set and no torchrun variables; afterwards the
    environment, working folder, import path and warnings' settings as they were."""
    changed = {**(env or {}), **dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))}
    saved_environment = {name: os.environ.get(name) for name in changed}
    saved_cwd, saved_path, saved_format = os.getcwd(), list(sys.path), warnings.formatwarning
    try:
        with warnings.catch_warnings():
            _set_environment(changed)
            os.chdir(cwd or REPO)
            yield
    finally:
        warnings.formatwarning = saved_format           # nnpd.main sets its own
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
        _set_environment(saved_environment)


def _set_environment(values):
    """Set os.environ's variables to the given values; None removes one."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _show_on_stderr(message, category, filename, lineno, file=None, line=None):
    """Show a warning as a fresh interpreter does: warnings.formatwarning's text on stderr."""
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


# ---------------------------------------------------------------- launches side by side

def side_by_side(calls, limit=4):
    """{key: call()} of independent zero-argument calls, made at the same time (at most `limit` at once).

    Most of a small launch of nnpd is spent importing torch on one core, so on a machine of few
    cores independent launches side by side end sooner than one after the other.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=limit) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
    return {key: future.result() for key, future in futures.items()}


def cases_to_run(request, test_name):
    """The parameters ({name: value}) of the cases of `test_name`, a parametrized test of the requesting
    module, that this session runs: those selected, less those a true skipif mark skips."""
    found = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or getattr(item, "originalname", None) != test_name:
            continue
        if any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")):
            continue
        found.append(item.callspec.params)
    return found


def case_key(params):
    """A parametrized case's parameters as a dictionary key (lists among them too)."""
    return repr(sorted(params.items()))


def ahead(request, tmp_path_factory, test_name, case):
    """`case(folder, **params)` of every case of `test_name` this session runs, side by side, each in a
    new folder of its own: {case_key(params): (folder, its outcome)}.

    For a module-scoped fixture of a parametrized test whose cases are independent launches; each
    case of the test takes its own with made_ahead (a case that raised raises there).
    """
    calls, folders = {}, {}
    for params in cases_to_run(request, test_name):
        key = case_key(params)
        folders[key] = tmp_path_factory.mktemp(test_name[5:40])
        calls[key] = functools.partial(_outcome, case, folders[key], params)
    return {key: (folders[key], outcome) for key, outcome in side_by_side(calls).items()}


def _outcome(case, folder, params):
    """(True, what case returned) or (False, the exception it raised)."""
    try:
        return True, case(folder, **params)
    except Exception as error:          # handed to the case's own test
        return False, error


def made_ahead(made, case, folder, **params):
    """(folder, what case returned) for this case as `ahead` made it; made now in `folder` if it was not."""
    key = case_key(params)
    if key not in made:
        return folder, case(folder, **params)
    folder, (returned, value) = made[key]
    if not returned:
        raise value
    return folder, value
