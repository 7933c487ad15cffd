"""Helpers the test modules share (conftest.py keeps the fixtures and the layer check).

Test modules import these from here and never from one another, so each module can be read,
moved or deleted alone.
"""

import concurrent.futures
import contextlib
import functools
import io
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import adaptive
import case_blocks
import designs
import gaussian
import nre_analysis
import runtime
import settings_training
import trainer
from store import Writer, write_bytes_atomic

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "decay"  # the decay-rate example of docs/extending.md

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


@contextlib.contextmanager
def recorded_figures():
    """Within the block every matplotlib Figure made (nnpd's own included) is appended to the list yielded."""
    import matplotlib.figure  # only the figure tests, which skip without matplotlib, call this

    figures = []

    class Recording(matplotlib.figure.Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.figure, "Figure", Recording)
        yield figures


def figure_legend_texts(figure):
    """The texts of every legend of a matplotlib figure: its own (the kit's, below the panels) and its axes'."""
    axes_legends = [axis.get_legend() for axis in figure.axes if axis.get_legend()]
    return [text.get_text() for legend in figure.legends + axes_legends for text in legend.get_texts()]


def write_settings(directory, root, training="", analysis="", tiny=True):
    """Copy the repository's settings files into `directory`, patched by the given code.

    The patch code runs inside make_settings with `settings` and `profile` in scope.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, patch, tiny_patch in (
        ("settings_training.py", training, TINY_TRAINING),
        ("settings_analysis.py", analysis, TINY_ANALYSIS),
    ):
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


def run_cli(*args, cwd=None, env=None, timeout=600):
    """Run `python nnpd.py ...` in a subprocess and return the completed process."""
    environment = {**os.environ, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), *args],
        cwd=cwd or REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
        warnings.resetwarnings()  # a fresh interpreter's filters and display
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show_on_stderr  # not into pytest's record of the test's warnings
        try:
            status = nnpd.main(list(args))
        except SystemExit as stop:  # argparse's usage errors
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except Exception:  # what would end a launch with a traceback
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
        warnings.formatwarning = saved_format  # nnpd.main sets its own
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
    except Exception as error:  # handed to the case's own test
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


# ---------------------------------------------------------------- launches: torchrun, signals, processes

# A CPU's BLAS picks its kernel by a matrix's shape and by the instruction set it finds, so the same
# row can round differently in a call of another size (a network's float32 logits, a batched float64
# product). Results that must not depend on how rows or cases are grouped agree to this tolerance, a
# few float32 ulps (2^-23 ≈ 1.2e-7) relative, not bitwise: README.md, "Tests and benchmarks".
GROUPING_ROUNDING = {"rtol": 2e-6, "atol": 2e-6}


def assert_same_but_rounding(actual, expected, what=""):
    """Floating arrays equal to within GROUPING_ROUNDING, every other array (flags, counts) bitwise."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_allclose(actual, expected, err_msg=what, **GROUPING_ROUNDING)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


TIMEOUT = 600  # seconds a launch may take before a test gives up on it

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")


def free_port():
    """A TCP port on the loopback interface that nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_environment(extra=None):
    """The test's environment without torchrun variables from an outer launch."""
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    environment["OMP_NUM_THREADS"] = "1"
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO)])
    return {**environment, **(extra or {})}


def torchrun(*args, nproc=2, extra_env=None, timeout=300):
    """Launch `nnpd.py` under torchrun on this machine and wait for it."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "nnpd.py"),
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=clean_environment(extra_env), cwd=REPO
    )


def start(arguments):
    """Start a launch in a session of its own (so its whole process group can be killed)."""
    return subprocess.Popen(
        arguments,
        env=clean_environment(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(condition, what, seconds=300, process=None):
    """Poll until condition() holds; fail at once, with its output, if the launch ended first.

    The deadline only guards against hanging.
    """
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            stdout, stderr = process.communicate()
            pytest.fail(f"the launch ended (exit {process.returncode}) before {what}:\n{stdout}\n{stderr}")
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def saved_states(root):
    """Training states saved in the store's scratch area."""
    return list(Path(root, "scratch", "model").glob("*.pt"))


def worker_pids(agent):
    """{rank: pid} of the processes torchrun's agent started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environment = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [item[5:] for item in environment if item.startswith(b"RANK=")]
        if parent == agent and rank:
            found[int(rank[0])] = int(entry.name)
    return found


def children(pid):
    """Process ids of a process's children (Linux /proc; none elsewhere)."""
    return [int(child) for path in Path(f"/proc/{pid}/task").glob("*/children") for child in path.read_text().split()]


def finish_agent(agent, seconds=TIMEOUT):
    """The output of a torchrun agent once it ends; past `seconds`, it and its workers are killed."""
    try:
        return agent.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        for pid in children(agent.pid) + [agent.pid]:
            os.kill(pid, signal.SIGKILL)
        agent.communicate()
        raise


# Tiny settings (one prior) that train long enough to be interrupted.
INTERRUPTIBLE_TRAINING = (
    'settings["data"]["train"] = 12_000\n'
    'settings["training"]["epochs"] = 3\n'
    'settings["training"]["batch_size"] = 64\n'
    'settings["cohort"]["priors"] = ["uniform"]\n'
    'settings["runtime"]["resume_seconds"] = 0.2\n'
)


def settings_for(folder, extra=""):
    """Settings of INTERRUPTIBLE_TRAINING (and `extra`) in folder/s, writing to folder/out."""
    return write_settings(folder / "s", folder / "out", training=INTERRUPTIBLE_TRAINING + extra)


def command(settings, action="train", workers=1, restarts=0):
    """The nnpd command line, under torchrun when several workers are asked for."""
    if workers == 1:
        return [sys.executable, str(REPO / "nnpd.py"), action, "--settings-dir", str(settings)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={workers}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--max-restarts={restarts}",
        str(REPO / "nnpd.py"),
        action,
        "--settings-dir",
        str(settings),
    ]


def finish_launch(arguments):
    """Run a launch to its end; returns the completed process."""
    return subprocess.run(arguments, env=clean_environment(), cwd=REPO, capture_output=True, text=True, timeout=600)


def weights(root):
    """{model key: state dict} of every committed model."""
    return {
        path.parent.name: torch.load(path, weights_only=True) for path in Path(root).glob("cache/model/*/weights.pt")
    }


def train_command(*launcher, settings):
    """`nnpd.py train` of the given settings, after an optional launcher (torchrun and its options)."""
    return [sys.executable, *launcher, str(REPO / "nnpd.py"), "train", "--settings-dir", str(settings)]


def limit_file_size(size):
    """For a child process: files may not grow past `size` bytes (EFBIG instead of SIGXFSZ)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


def one_error_line(result):
    """The single stderr line of a refused command."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# ---------------------------------------------------------------- copies of the repository and of studies' settings

# What a copy of the repository leaves out: what .gitignore ignores, and the git folder.
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "outputs", "__pycache__", "*.pyc", "*.egg-info", "build", ".pytest_cache", ".hypothesis", "*.so"
)


def repository_copy(target):
    """A copy of the repository's files at `target` (no git folder, virtual environment or outputs)."""
    shutil.copytree(REPO, target, ignore=LEFT_OUT)
    return target


def toy_settings(tmp_path, **training):
    """The toy study's settings writing to tmp_path/out, with training sizes replaced (e.g. train=20000)."""
    folder = tmp_path / "s"
    folder.mkdir()
    for name in ("settings_training.py", "settings_analysis.py"):
        text = (REPO / "tests" / "toy_settings" / name).read_text().replace("OUTPUT_ROOT", str(tmp_path / "out"))
        text = text.replace('"train": 2048', f'"train": {training.get("train", 2048)}')
        (folder / name).write_text(text.replace('"epochs": 6', f'"epochs": {training.get("epochs", 6)}'))
    return folder


def toy_environment():
    """The environment of a launch of the toy study (its module lives in tests/)."""
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**environment, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}


def patched_settings(tmp_path, replacements):
    """A copy of the example's folder (its study module too) with text replaced ({old: new}; each must occur once)."""
    folder = tmp_path / "settings"
    folder.mkdir()
    texts = {path.name: path.read_text() for path in EXAMPLE.glob("*.py")}
    for old, new in replacements.items():
        assert sum(old in text for text in texts.values()) == 1, old
        texts = {name: text.replace(old, new) for name, text in texts.items()}
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder


# ---------------------------------------------------------------- a kit study beside its settings

LINE_STUDY = '''
import nre_study
import torch


def noise_scale():
    return {noise}


class Line(nre_study.Study):
    """x = slope * (-1, 0, 1) + offset + noise."""

    parameters = {{"slope": (-1.0, 1.0), "offset": (-1.0, 1.0)}}

    def simulate(self, theta, generator):
        noise = torch.randn(theta.shape[0], 3, generator=generator, dtype=torch.float64)
        return theta[:, :1] * torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) + theta[:, 1:] + noise_scale() * noise
'''
KIT_TRAINING = """
settings["experiment"] = "{module}:Line"
del settings["problem"]
settings["cohort"]["priors"] = ["uniform"]
"""
KIT_ANALYSIS = """
settings["analysis"] = "nre_analysis:NREAnalysis"
settings["inference"]["truths"]["align_truths_to_grid"] = False
settings["inference"]["truths"]["truth_points_per_axis"] = 2
settings["inference"]["targets"] = ["ratio"]
settings["metrics"] = ["classification", "coverage"]
"""


def module_name(tmp_path):
    """The test's own study module name (modules of one name would be cached across tests)."""
    return f"kit_{tmp_path.name}"


def kit_study(tmp_path, extra="", training="", analysis="", noise=0.3):
    """A settings folder holding a kit study module; returns (folder, module name, output root)."""
    module = module_name(tmp_path)
    folder = write_settings(
        tmp_path / "settings", tmp_path / "out", KIT_TRAINING.format(module=module) + training, KIT_ANALYSIS + analysis
    )
    (folder / f"{module}.py").write_text(LINE_STUDY.format(noise=noise) + textwrap.dedent(extra))
    return folder, module, tmp_path / "out"


def without_pythonpath():
    """The environment with no PYTHONPATH: only the settings folder can make the study importable."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def run_without_pythonpath(*args):
    """`python nnpd.py ...` from the repository root with PYTHONPATH unset."""
    environment = without_pythonpath()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------- a small training problem with resumable state

CPU = runtime.Runtime(device=torch.device("cpu"))

SEED = 11


# 300 rows in batches of 32: 10 batches per epoch (the last has 12 rows), 30 steps in all.
ROWS, BATCHES, EPOCHS = 300, 10, 3

SETTINGS = {
    "epochs": EPOCHS,
    "batch_size": 32,
    "learning_rate": 0.02,
    "gradient_clip": 1.0,
    "objective": "balanced",
    "balance_weight": 2.0,
    "checkpoint": "best",
}


def make_data(rows=ROWS, validation=100, seed=0):
    """A noisy linear classification problem."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + validation, 2, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * torch.randn(rows + validation, generator=g) > 0).float()
    return {
        "train_inputs": x[:rows],
        "train_labels": y[:rows],
        "validation_inputs": x[rows:],
        "validation_labels": y[rows:],
    }


def make_model(seed=0, hidden=16):
    """A small MLP with dropout, so the global random stream matters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(2, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(hidden, 1),
        torch.nn.Flatten(0),
    )


def save_atomically(state, path):
    """torch.save the state through the store's atomic write (temporary file, fsync, rename), as nnpd does."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def load_if_present(path):
    """The saved state at `path`, or None."""
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


class Recorder:
    """Hooks backed by a real file that count what the trainer asked of them."""

    def __init__(self, path, save_seconds=math.inf, stop_after=None):
        self.path, self.save_seconds, self.stop_after = path, save_seconds, stop_after
        self.saves, self.polls, self.resumed, self.epochs = 0, 0, [], []

    def save(self, state):
        """Persist and count."""
        save_atomically(state, self.path)
        self.saves += 1

    def stop(self):
        """Ask to stop from the `stop_after`-th poll on."""
        self.polls += 1
        return self.stop_after is not None and self.polls >= self.stop_after

    def hooks(self, load=True):
        """The TrainingHooks wired to this recorder."""
        return trainer.TrainingHooks(
            load_state=(lambda: load_if_present(self.path)) if load else None,
            save_state=self.save,
            save_seconds=self.save_seconds,
            stop_requested=self.stop,
            on_epoch=lambda epoch, record: self.epochs.append((epoch, record)),
            on_resume=lambda epoch, batch: self.resumed.append((epoch, batch)),
        )


# ---------------------------------------------------------------- the bundled study's exact target

LEVELS = [0.68, 0.95]


def study_problem(dimension):
    """The bundled study's Gaussian problem (σ = 2, means in [0, 10]) at a dimension."""
    problem = dict(settings_training.base_settings("default")["problem"], dimension=dimension)
    return gaussian.GaussianProblem.from_settings(problem)


def log_likelihood(x, theta):
    """log p(x | θ) of the study's problem when only the means are inferred (σ = 2), in few operations."""
    z = (x - theta) / 2.0
    return (-0.5 * z * z).sum(dim=-1) - x.shape[-1] * math.log(2.0 * math.sqrt(2 * math.pi))


def exact_summaries(tmp_path, problem, truths, observations, candidates, name):
    """Every case's exact-target summaries on a design, through the study's summarise functions."""
    p = problem.parameter_count
    seed = 11
    points, log_measure = designs.make_candidates(problem.low, problem.high, [None] * p, candidates, seed)

    scoring = case_blocks.exact_scoring(log_likelihood, observations, torch.device("cpu"), 1 << 24)
    writer = Writer(tmp_path / name)
    (tmp_path / name).mkdir()
    box = adaptive.support_box(problem.low, problem.high, [None] * p)
    sizes = designs.adaptive_sizes(p, candidates, 1) if candidates["kind"] == "adaptive" else None
    design = case_blocks.Design(candidates["kind"], [None] * p, adaptive.Refinement(box, LEVELS, sizes, seed))
    work = nre_analysis.Cases(
        ["exact"], truths, case_blocks.Candidates(points, log_measure), {"mode": "diagnostic", "cases": 0}
    )
    nre_analysis.summarise_cases(writer, scoring, design, work, lambda case: None)
    return {field: np.load(tmp_path / name / f"exact_{field}.npy") for field in nre_analysis.SUMMARY_FIELDS}


# ---------------------------------------------------------------- test layers

LAYERS = ("unit", "property", "launch")  # what each means: pyproject.toml's pytest markers


def layer_problems(items):
    """'node id: what is wrong' for each test without exactly one layer marker, or a property test
    that is not a Hypothesis test."""
    problems = []
    for item in items:
        layers = [name for name in LAYERS if item.get_closest_marker(name) is not None]
        if len(layers) != 1:
            problems.append(
                f"{item.nodeid}: {' and '.join(layers) or 'no layer'} (give it exactly one of {', '.join(LAYERS)})"
            )
        elif layers == ["property"] and not getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            problems.append(f"{item.nodeid}: property, but not a Hypothesis test (@given)")
    return problems


class LayerCheck:
    """A pytest plugin: collection fails, naming each test, when a test has no layer marker or several, so
    that every new test chooses whether `make test-fast` runs it."""

    @pytest.hookimpl(tryfirst=True)  # every collected test, before -m or -k deselects any
    def pytest_collection_modifyitems(self, items):
        problems = layer_problems(items)
        if problems:
            raise pytest.UsageError(
                'each test needs exactly one layer marker (README.md, "Tests and benchmarks"):\n  '
                + "\n  ".join(problems)
            )
