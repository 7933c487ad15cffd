"""Settings: loading the two settings files, Choice and one-factor-at-a-time expansion,
identity digests, and the checks of every section the framework itself reads.

A settings file holds one profile as a dict `SETTINGS`, or several as `PROFILES`, `DEFAULT_PROFILE`
and `make_settings(profile)` (README.md, "The settings files"). Training settings need only
`experiment`: `output`, `seed` and `runtime` default (fill_training_defaults).

The framework's sections (`output`, `seed`, `runtime`, `verification`, `plotting`, and the
`metrics`/`plots`/`cohort_plots` lists) are checked here; the bundled trainer checks
`training` (trainer.py) and a study checks its own sections (its `validate()`), all with
the helpers below, so each section's rules stand in one place.
"""

import contextlib
import copy
import dataclasses
import itertools
import math
import os
import re
import signal
import sys
import threading
import types
from pathlib import Path

import store

__all__ = [
    "SettingsError",
    "is_integer",
    "is_number",
    "require",
    "known_keys",
    "number",
    "integer",
    "one_of",
    "safe_name",
    "name_list",
    "TRAINING_SECTIONS",
    "ANALYSIS_SECTIONS",
    "LAUNCH_INVARIANT",
    "Choice",
    "Configuration",
    "Profile",
    "canonical_json",
    "digest",
    "check_structure",
    "resolve",
    "to_jsonable",
    "identity",
    "expand",
    "check_training",
    "check_analysis",
    "RUNTIME_DEFAULTS",
    "DEVICE_FORMS",
    "check_runtime",
    "check_framework",
    "make_study_importable",
    "load_profile",
    "fill_training_defaults",
    "single_profile_name",
    "SEED_DEFAULT",
    "FORMAT_DOCS",
]


class SettingsError(store.NnpdError, ValueError):
    """A settings problem the user can fix; the message names the setting."""


def is_integer(value):
    """True for a real int (a bool is not one, though Python says True == 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------- checks shared by every section

# Names that become folder names or keys: letters, digits, '_', '-', '.' inside, no '..'.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def require(mapping, key, path):
    """mapping[key], or an error naming the missing setting."""
    if not isinstance(mapping, dict):
        raise SettingsError(f"{path}: expected a dict, got {type(mapping).__name__}")
    if key not in mapping:
        raise SettingsError(f"{path}.{key} is missing; add it to the settings ({FORMAT_DOCS} says which a study needs)")
    return mapping[key]


def known_keys(mapping, known, path):
    """Reject keys outside `known` (usually typos), listing the valid ones."""
    if not isinstance(mapping, dict):
        raise SettingsError(f"{path}: expected a dict with keys {', '.join(known)}, got {type(mapping).__name__}")
    for key in mapping:
        if key not in known:
            raise SettingsError(f"{path}.{key} is not a known setting; use one of {', '.join(known)}")


def number(value, path, low=-math.inf, high=math.inf, low_open=False):
    """value as a finite float in [low, high] ((low, high] when low_open), else an error."""
    inside = is_number(value) and math.isfinite(value) and low <= value <= high and not (low_open and value == low)
    if not inside:
        bracket = "(" if low_open else "["
        raise SettingsError(f"{path}: expected a finite number in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def integer(value, path, minimum=0, maximum=2**62):
    """value as an int in [minimum, maximum], else an error."""
    if not is_integer(value) or not minimum <= value <= maximum:
        raise SettingsError(f"{path}: expected an integer from {minimum} to {maximum:g}, got {value!r}")
    return value


def one_of(value, options, path):
    """value when it is one of options, else an error listing them."""
    if not isinstance(value, (str, bool, int, float, type(None))) or value not in options:
        raise SettingsError(f"{path}: {value!r} is not valid; use one of {', '.join(map(repr, options))}")
    return value


def safe_name(value, path):
    """A name that may become a folder or file name: up to 64 letters, digits, '_', '-' or '.'."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value:
        raise SettingsError(
            f"{path}: {value!r} is not a safe name; use up to 64 letters, digits, '_', '-' "
            "or '.', starting with a letter or digit (no '/', '..' or spaces)"
        )
    return value


def name_list(value, path, allow_empty=True):
    """A list of distinct safe names."""
    if not isinstance(value, list) or (not value and not allow_empty):
        raise SettingsError(f"{path}: expected a {'' if allow_empty else 'non-empty '}list of names, got {value!r}")
    for index, item in enumerate(value):
        safe_name(item, f"{path}[{index}]")
    repeated = sorted({item for item in value if value.count(item) > 1})
    if repeated:
        raise SettingsError(f"{path}: listed more than once: {', '.join(repeated)}")
    return value


# The framework's own sections; a study's sections beside them are the study's to check
# (study_loading.check_study_sections and the study's validate()).
TRAINING_SECTIONS = ("experiment", "output", "seed", "runtime")
TRAINING_REQUIRED = ("experiment",)  # the others default (fill_training_defaults)
SEED_DEFAULT = 0
ANALYSIS_SECTIONS = ("analysis", "verification", "metrics", "plots", "cohort_plots", "plotting")
LAUNCH_INVARIANT = ("experiment", "output", "runtime")
TRAINING_FILE = "settings_training.py"
ANALYSIS_FILE = "settings_analysis.py"
# A single-profile settings file: one dict of sections under this name, no PROFILES/make_settings.
SINGLE = "SETTINGS"
# Where every error about the files' form sends the reader (tests/test_docs.py checks the heading exists).
FORMAT_DOCS = 'README.md, "The settings files"'

_CLASS_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SCALARS = (str, int, float, bool, type(None))
_load_counter = itertools.count()


class Choice:
    """Alternatives of one setting; the first option is the baseline."""

    __hash__ = None  # type: ignore[assignment]  # options may hold lists, so a Choice is unhashable

    def __init__(self, options):
        """Keep the options as a list (emptiness is reported with its path later)."""
        if not isinstance(options, (list, tuple)):
            raise SettingsError(
                f"Choice(options): options must be a list or tuple, got "
                f"{type(options).__name__}; write Choice([a, b, ...])"
            )
        self.options = list(options)

    def __repr__(self):
        """Read like the code that built it."""
        return f"Choice({self.options!r})"

    def __eq__(self, other):
        """Two Choices are equal when their options are."""
        if not isinstance(other, Choice):
            return NotImplemented
        return self.options == other.options


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One resolved configuration of a launch: baseline or one changed knob."""

    settings: dict
    knob: str | None
    value: object
    variant: str
    digest: str

    @property
    def name(self):
        """Readable, unique folder name: the changed knob and its value, then a digest."""
        if self.knob is None:
            return f"{self.variant}-{self.digest[:10]}"
        shown = re.sub(r"[^A-Za-z0-9_.,+-]+", "_", canonical_json(self.value).strip('"'))[:40].strip("._")
        return f"{self.variant}={shown or 'value'}-{self.digest[:10]}"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A loaded profile: both settings trees and the configurations they expand to."""

    name: str
    settings_dir: Path
    training_path: Path
    analysis_path: Path
    training: dict
    analysis: dict
    configurations: list


# ---------------------------------------------------------------- identity


def canonical_json(value):
    """Canonical JSON text of settings; what JSON cannot hold is a SettingsError."""
    try:
        return store.canonical_json(value)
    except (ValueError, TypeError) as error:
        raise SettingsError(
            f"cannot serialise settings: {error}; use finite numbers and plain dict/list/str/int/float/bool/None only"
        ) from None


def digest(value):
    """SHA-256 hex digest of the canonical JSON of value."""
    return store.sha256_text(canonical_json(value))


# ---------------------------------------------------------------- structure


def _key_path(path, key):
    """Dotted path of a dict entry."""
    return f"{path}.{key}" if path else key


def _show(path):
    """Path as printed in messages; the root has no name."""
    return path or "<top level>"


def _fail(where, path, problem):
    """Raise a SettingsError naming where, the dotted path and the problem."""
    raise SettingsError(f"{where} {_show(path)}: {problem}")


def check_structure(settings, where="settings"):
    """Reject bad keys, non-finite numbers, misplaced or empty Choices, non-JSON values."""
    if not isinstance(settings, dict):
        _fail(where, "", f"settings must be a dict of sections, got {type(settings).__name__} ({FORMAT_DOCS})")
    _check_node(settings, "", where, allow_choice=True)


# Deeper nesting than this is surely a mistake (and would exhaust Python's recursion limit).
MAX_DEPTH = 32


def _check_node(value, path, where, allow_choice, depth=0):
    """Check one value and everything below it."""
    if depth > MAX_DEPTH:
        _fail(
            where, path, f"settings nest deeper than {MAX_DEPTH} levels (a value that contains itself?); flatten them"
        )
    if isinstance(value, Choice):
        _check_choice(value, path, where, allow_choice, depth)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_key(key, path, where)
            _check_node(item, _key_path(path, key), where, allow_choice, depth + 1)
    elif isinstance(value, (list, tuple)):
        # A plain list is one value, so it cannot hold alternatives.
        for index, item in enumerate(value):
            _check_node(item, f"{path}[{index}]", where, False, depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            _fail(where, path, f"{value!r} is not allowed; use a finite number (or None for 'no value')")
    elif not isinstance(value, _SCALARS):
        _fail(
            where,
            path,
            f"value of type {type(value).__name__} is not allowed; "
            "use dict, list, str, int, float, bool, None or Choice",
        )


def _check_choice(choice, path, where, allow_choice, depth):
    """Check one Choice: placed in a dict, non-empty, options free of Choices."""
    if not allow_choice:
        _fail(
            where,
            path,
            "a Choice may not be nested inside a Choice option or a "
            "plain list; make the whole value a Choice of complete "
            "alternatives instead",
        )
    if not choice.options:
        _fail(where, path, "empty Choice; give at least one option (the first is the baseline)")
    for index, option in enumerate(choice.options):
        _check_node(option, f"{path}[option {index}]", where, False, depth + 1)


def _check_key(key, path, where):
    """Keys are non-empty strings without dots (dots separate knob paths)."""
    if not isinstance(key, str):
        _fail(where, path, f"key {key!r} is not a string; use string keys")
    if not key:
        _fail(where, path, "empty key; give the setting a name")
    if not key.isprintable() or len(key) > 64:
        _fail(where, path, f"key {key!r} is too long or has control characters; give the setting a plain name")
    if "." in key:
        _fail(where, path, f"key {key!r} contains a dot; dots separate setting paths, use '_' instead")


# ---------------------------------------------------------------- resolution


def resolve(value):
    """A plain copy with every Choice at its first option (tuples become lists)."""
    if isinstance(value, Choice):
        return resolve(value.options[0])
    if isinstance(value, dict):
        return {key: resolve(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [resolve(item) for item in value]
    return value


def to_jsonable(settings):
    """A copy with each Choice shown as {"choice": [...]}, for printing plans."""
    if isinstance(settings, Choice):
        return {"choice": [to_jsonable(option) for option in settings.options]}
    if isinstance(settings, dict):
        return {key: to_jsonable(item) for key, item in settings.items()}
    if isinstance(settings, (list, tuple)):
        return [to_jsonable(item) for item in settings]
    return settings


def _choices(value, path=()):
    """(key path tuple, Choice) pairs, depth first in dict order."""
    if isinstance(value, Choice):
        return [(path, value)]
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(_choices(item, path + (key,)))
    return found


def _with_value(settings, path, value):
    """A deep copy of settings with the entry at path replaced by value."""
    changed = copy.deepcopy(settings)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return changed


def identity(settings):
    """The digest of what settings compute: everything but where the results are written.

    An output root can be moved or copied; its run folders keep their names.
    """
    return digest({key: value for key, value in to_jsonable(settings).items() if key != "output"})


def _configuration(settings, knob, value, variant):
    """Build a Configuration with its digest."""
    return Configuration(settings=settings, knob=knob, value=value, variant=variant, digest=identity(settings))


def expand(settings):
    """Baseline plus one configuration per further option of each Choice, deduplicated."""
    check_structure(settings)
    baseline = resolve(settings)
    candidates = [_configuration(baseline, None, None, "baseline")]
    for path, choice in _choices(settings):
        knob = ".".join(path)
        for option in choice.options[1:]:
            value = resolve(option)
            changed = _with_value(baseline, path, copy.deepcopy(value))
            candidates.append(_configuration(changed, knob, value, knob.replace(".", "_")))
    kept, seen = [], set()
    for candidate in candidates:
        if candidate.digest not in seen:
            seen.add(candidate.digest)
            kept.append(candidate)
    return kept


# ---------------------------------------------------------------- profile checks


def _first_choice_path(value, path=""):
    """Dotted path of the first Choice in value (depth first), or None."""
    if isinstance(value, Choice):
        return path
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_choice_path(item, _key_path(path, key))
            if found is not None:
                return found
    return None


def check_sections(settings, required, where):
    """Every required framework section is present (the study checks its own sections)."""
    missing = [name for name in required if name not in settings]
    if missing:
        raise SettingsError(
            f"{where}: missing sections: {', '.join(missing)}; add them beside the study's own ({FORMAT_DOCS})"
        )


def check_class_ref(settings, section, where):
    """A section naming a class must read 'module:Class'."""
    value = settings[section]
    if not isinstance(value, str) or not _CLASS_REF.match(value):
        _fail(where, section, f"{value!r} is not of the form 'module:Class'; write e.g. 'my_study:MyExperiment'")


def check_training(settings, where="settings_training.py"):
    """Structure, sections, launch invariants and class reference of training settings."""
    check_structure(settings, where)
    check_sections(settings, TRAINING_REQUIRED, where)
    for section in LAUNCH_INVARIANT:
        path = _first_choice_path(settings[section], section)
        if path is not None:
            _fail(
                where,
                path,
                f"'{section}' may not vary within a launch; remove the Choice and compare with separate launches",
            )
    check_class_ref(settings, "experiment", where)


def fill_training_defaults(settings, profile):
    """The framework's training sections a file leaves out, filled in place before the settings are expanded:
    `output.root` "outputs/<profile>", `seed` SEED_DEFAULT and `runtime` {} (RUNTIME_DEFAULTS).

    Filled, they enter the identity as if written out; a value of the wrong type is left for the checks.
    """
    if isinstance(settings, dict):
        output = settings.get("output", {})
        if isinstance(output, dict):
            settings["output"] = {"root": f"outputs/{profile}", **output}
        settings.setdefault("seed", SEED_DEFAULT)
        settings.setdefault("runtime", {})
    return settings


def check_analysis(settings, where="settings_analysis.py"):
    """Structure, sections, no Choice and class reference of analysis settings; fills the framework's defaults.

    Only `analysis` is required: the other framework sections default to ANALYSIS_DEFAULTS, and
    `metrics`, `plots` and `cohort_plots` to what the analysis class selects (study_loading.load_study).
    """
    check_structure(settings, where)
    check_sections(settings, ("analysis",), where)
    for section, value in ANALYSIS_DEFAULTS.items():
        settings.setdefault(section, copy.deepcopy(value))
    path = _first_choice_path(settings)
    if path is not None:
        _fail(where, path, "analysis is not swept; remove the Choice, edit settings_analysis.py and re-run analyze")
    check_class_ref(settings, "analysis", where)


# ---------------------------------------------------------------- the framework's own sections

RUNTIME_DEFAULTS = {
    "device": "auto",
    "parallel": "jobs",
    "cpu_threads": 1,
    "deterministic": True,
    "timeout_minutes": 60,
    "resume_seconds": 60,
}
PARALLEL_MODES = ("jobs", "ddp")
DEVICE_FORMS = '"auto", "cpu", "cuda" or "cuda:N" (N = GPU index)'
LIMITS = ("max_model_evaluations", "max_saved_bytes", "max_candidate_points")
PLOT_FORMATS = ("png", "pdf", "svg")
# The framework's analysis sections a settings_analysis.py may leave out. The limits are the bundled
# profiles' own: they let the default profile's largest analysis through and stop a typo's.
LIMIT_DEFAULTS = {"max_model_evaluations": 2e12, "max_saved_bytes": 8e9, "max_candidate_points": 2e6}
PLOTTING_DEFAULTS = {"format": "png", "dpi": 120}
ANALYSIS_DEFAULTS = {"verification": LIMIT_DEFAULTS, "plotting": PLOTTING_DEFAULTS}


def check_runtime(runtime_settings):
    """The `runtime` section with defaults filled in (the device string is resolved by runtime.py)."""
    given = runtime_settings
    known_keys(given, tuple(RUNTIME_DEFAULTS), "runtime")
    settings = {**RUNTIME_DEFAULTS, **given}
    if not isinstance(settings["device"], str) or not settings["device"].isprintable() or len(settings["device"]) > 32:
        raise SettingsError(f"runtime.device: expected one of {DEVICE_FORMS}; got {settings['device']!r}")
    one_of(settings["parallel"], PARALLEL_MODES, "runtime.parallel")
    integer(settings["cpu_threads"], "runtime.cpu_threads", 1, 4096)
    one_of(settings["deterministic"], (True, False), "runtime.deterministic")
    number(settings["timeout_minutes"], "runtime.timeout_minutes", 0, 10**6, low_open=True)
    number(settings["resume_seconds"], "runtime.resume_seconds", 0, 10**6)
    return settings


def check_output_root(output):
    """The `output` section's root with a leading `~` expanded (whether it may be used is checked at launch)."""
    known_keys(output, ("root",), "output")
    root = require(output, "root", "output")
    if not isinstance(root, str) or not root.strip():
        raise SettingsError(f'output.root: expected a non-empty path, e.g. "outputs/<profile>"; got {root!r}')
    if root != root.strip() or not root.isprintable() or len(root) > 1024:
        raise SettingsError(
            f"output.root: {root!r} has surrounding spaces, control characters or is too long; write a plain path"
        )
    # As a shell would: "~/x" is in the home folder, never a folder named "~" here.
    root = os.path.expanduser(root)
    if root.startswith("~"):
        raise SettingsError(f"output.root: {root!r} starts with '~' but names no home folder here; write the full path")
    if ".." in Path(root).parts:
        raise SettingsError(f"output.root: {root!r} climbs out with '..'; write the path without '..'")
    if any(len(part.encode("utf-8")) > 255 for part in Path(root).parts):
        raise SettingsError(f"output.root: a folder name in {root[:60]!r}... is longer than 255 bytes; shorten it")
    return root


def check_seed(seed):
    """The `seed`: a non-negative integer below 2**63."""
    return integer(seed, "seed", 0, 2**63 - 1)


def check_analysis_framework(analysis):
    """The analysis sections the framework reads: limits, figure format, selected names."""
    known_keys(analysis["verification"], LIMITS, "verification")
    analysis["verification"] = limits = {**LIMIT_DEFAULTS, **analysis["verification"]}
    for name in LIMITS:
        number(limits[name], f"verification.{name}", 0, 1e18, low_open=True)
    known_keys(analysis["plotting"], tuple(PLOTTING_DEFAULTS), "plotting")
    analysis["plotting"] = plotting = {**PLOTTING_DEFAULTS, **analysis["plotting"]}
    one_of(plotting["format"], PLOT_FORMATS, "plotting.format")
    integer(plotting["dpi"], "plotting.dpi", 1, 2400)
    if "metrics" in analysis:  # else the analysis class chooses them (study_loading.load_study), and the figures
        name_list(analysis["metrics"], "metrics", allow_empty=False)
    for name in ("plots", "cohort_plots"):
        if name in analysis:
            name_list(analysis[name], name)


def check_framework(profile):
    """Every framework section of a loaded profile; per-configuration values are checked per configuration.

    output.root is replaced by its checked form (`~` expanded), which every command then uses.
    """
    root = check_output_root(profile.training["output"])
    profile.training["output"] = {**profile.training["output"], "root": root}
    check_runtime(profile.training["runtime"])
    check_analysis_framework(profile.analysis)
    for configuration in profile.configurations:
        check_seed(configuration.settings["seed"])


# ---------------------------------------------------------------- loading


def _load_module(path):
    """Execute a settings file as a fresh module, writing nothing to disk."""
    if not path.is_file():
        raise SettingsError(
            f"{path}: settings file not found; create it or pass "
            "--settings-dir pointing at the folder holding "
            f"{TRAINING_FILE} and {ANALYSIS_FILE}"
        )
    # A unique name keeps two settings folders apart and leaves the real names free.
    name = f"_nnpd_settings_{path.stem}_{next(_load_counter)}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    # Settings files written before this module's rename say `from sweep import Choice`.
    sys.modules.setdefault("sweep", sys.modules[__name__])
    writes_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # also for anything the settings file imports
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        with _no_exit() as pressed, _siblings_first(path.parent):
            code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
            exec(code, module.__dict__)
    except BaseException as error:
        _reraise_ctrl_c(error, pressed)
        raise SettingsError(f"{path}: could not be executed: {_described(error)}; fix the file") from None
    finally:
        sys.modules.pop(name, None)
        sys.dont_write_bytecode = writes_bytecode
    return module


@contextlib.contextmanager
def _siblings_first(folder):
    """While a settings file runs, `import settings_training` (or `settings_analysis`) finds its sibling in
    `folder`, not nnpd's own file first on the import path; the import path and modules are put back after."""
    stems = (Path(TRAINING_FILE).stem, Path(ANALYSIS_FILE).stem)
    siblings = [stem for stem in stems if (folder / f"{stem}.py").is_file()]
    saved_path, saved = list(sys.path), {stem: sys.modules.pop(stem) for stem in siblings if stem in sys.modules}
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for stem in siblings:
            sys.modules.pop(stem, None)
        sys.modules.update(saved)


def _refuse_exit(status=0):
    """Stands in for os._exit while settings code runs: a settings file may not end nnpd."""
    raise SystemExit(f"os._exit({status}) called")


@contextlib.contextmanager
def _no_exit():
    """Run settings code with os._exit turned into an exception (sys.exit already is one).

    Yields a list that records every real Ctrl-C (SIGINT) meanwhile, so that a settings
    file raising KeyboardInterrupt itself is told apart from a user who stops nnpd.
    """
    hard_exit, os._exit = os._exit, _refuse_exit
    pressed: list[int] = []
    previous = _note_ctrl_c(pressed)
    try:
        yield pressed
    finally:
        os._exit = hard_exit
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _note_ctrl_c(pressed):
    """Handle SIGINT as before, noting it in `pressed`; returns the handler to put back, None if none was changed.

    Off the main thread no signal reaches Python code, and a handler set by C code cannot be
    put back, so then nothing changes.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        return None

    def noted(signum, frame):
        pressed.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, noted)
    return previous


def _reraise_ctrl_c(error, pressed):
    """Let a real Ctrl-C or nnpd's own stop (SIGTERM: an NnpdError that is a KeyboardInterrupt) stop nnpd as
    usual; any other exception of settings code is a settings error."""
    if isinstance(error, KeyboardInterrupt) and (pressed or isinstance(error, store.NnpdError)):
        raise error


def _described(error):
    """An exception of settings code as 'Type: message' (just the type when it has no message)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _attribute(module, path, attribute):
    """A required module-level name of a settings file."""
    if not hasattr(module, attribute):
        raise SettingsError(f"{path}: {attribute} is not defined; define it ({FORMAT_DOCS})")
    return getattr(module, attribute)


def _profiles(module, path):
    """The profile names of a settings file (its PROFILES), or None for a single-profile file (its SETTINGS)."""
    if hasattr(module, SINGLE) and hasattr(module, "PROFILES"):
        raise SettingsError(
            f"{path}: defines both {SINGLE} and PROFILES; keep {SINGLE} for one profile, or "
            f"PROFILES with make_settings for several ({FORMAT_DOCS})"
        )
    if hasattr(module, SINGLE):
        return None
    if not hasattr(module, "PROFILES"):
        raise SettingsError(
            f"{path}: defines neither {SINGLE} (a dict of sections: one profile) nor PROFILES "
            f"with make_settings (several); define one ({FORMAT_DOCS})"
        )
    names = module.PROFILES
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise SettingsError(f"{path}: PROFILES must be a tuple of profile names ({FORMAT_DOCS})")
    return list(names)


def single_profile_name(settings_dir):
    """The name of a single-profile file's profile: its folder's, as a safe name ("study" when none is left)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(settings_dir).name)[:64].strip("._-").replace("..", "_")
    return name or "study"


def _profile_name(module, path, settings_dir, asked):
    """The profile a launch uses: the asked one (else DEFAULT_PROFILE) of PROFILES, or a SETTINGS file's own."""
    known = _profiles(module, path)
    if known is None:
        name = single_profile_name(settings_dir)
        if asked not in (None, name):
            raise SettingsError(
                f"{path}: holds one profile, {name!r} ({SINGLE}, named after its folder), not "
                f"{asked!r}; leave out --profile ({FORMAT_DOCS})"
            )
        return name
    profile = _attribute(module, path, "DEFAULT_PROFILE") if asked is None else asked
    if profile not in known:
        raise SettingsError(f"unknown profile {profile!r}; known profiles: {', '.join(known)} (from {path})")
    return profile


def _make(module, path, profile):
    """A copy of the file's SETTINGS, or make_settings(profile), its failures turned into SettingsError."""
    if hasattr(module, SINGLE):
        settings, where = getattr(module, SINGLE), f"{SINGLE} is a"
        if isinstance(settings, dict):
            return copy.deepcopy(settings)  # deepcopy keeps Choice objects
    else:
        settings, where = _called_make_settings(module, path, profile), "make_settings returned a"
    if not isinstance(settings, dict):
        raise SettingsError(
            f"{path.name} [{profile}]: {where} {type(settings).__name__}; it must be a dict of sections ({FORMAT_DOCS})"
        )
    return settings


def _called_make_settings(module, path, profile):
    """make_settings(profile), turning its failures into SettingsError."""
    make_settings = _attribute(module, path, "make_settings")
    try:
        with _no_exit() as pressed:
            return make_settings(profile)
    except SettingsError as error:
        raise SettingsError(f"{path.name} [{profile}]: {error}") from None
    except BaseException as error:
        _reraise_ctrl_c(error, pressed)
        raise SettingsError(f"{path.name} [{profile}]: make_settings failed: {_described(error)}") from None


def make_study_importable(profile):
    """Make a study module beside the profile's settings files importable without PYTHONPATH (last on sys.path).

    For a launch, which imports the study and, lazily, what it imports; loading settings
    alone changes no import path (nnpd.main restores it when its launch ends).
    """
    if str(profile.settings_dir) not in sys.path:
        sys.path.append(str(profile.settings_dir))


def load_profile(settings_dir, profile=None, training_dir=None):
    """Load, validate and expand one profile from the two settings files in settings_dir.

    `training_dir`, when given, supplies settings_training.py instead (analyze uses
    the copy of the latest training's file in the output root).
    """
    settings_dir = Path(settings_dir).absolute()
    training_path = Path(training_dir or settings_dir).absolute() / TRAINING_FILE
    analysis_path = settings_dir / ANALYSIS_FILE
    training_module = _load_module(training_path)
    analysis_module = _load_module(analysis_path)
    profile = _profile_name(training_module, training_path, settings_dir, profile)
    if profile not in (_profiles(analysis_module, analysis_path) or [profile]):  # a SETTINGS file serves any
        raise SettingsError(
            f"{analysis_path}: profile {profile!r} is missing from PROFILES; add it so both files "
            f"define the same profiles, or give the analysis one {SINGLE} dict ({FORMAT_DOCS})"
        )
    training = fill_training_defaults(_make(training_module, training_path, profile), profile)
    analysis = _make(analysis_module, analysis_path, profile)
    check_training(training, f"{TRAINING_FILE} [{profile}]")
    check_analysis(analysis, f"{ANALYSIS_FILE} [{profile}]")
    return Profile(
        name=profile,
        settings_dir=settings_dir,
        training_path=training_path,
        analysis_path=analysis_path,
        training=training,
        analysis=analysis,
        configurations=expand(training),
    )
