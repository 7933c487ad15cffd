"""The output root's bookkeeping: ownership, the launch lease, run folders, history and clean-up.

An output root belongs to nnpd: it carries a marker file written when nnpd created it, and
clean-up removes only what nnpd recorded as its own, never following a symbolic link. One
launch at a time works in a root (a lease held for the whole launch); a second one waits.
What the README calls "latest settings win" is implemented by `record_launch` and `clean_up`.
"""

import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

from store import (
    ATOMIC_LEFTOVER,
    ROOT_MARKER,
    DamagedArtifact,
    LaunchError,
    digest,
    now_iso,
    own_folder,
    record_checksum,
    refuse_link,
    write_bytes_atomic,
    write_json_atomic,
)

__all__ = [
    "warn",
    "read_json",
    "refuse_wrong_root",
    "owns_root",
    "root_errors",
    "claim_root",
    "refuse_unsafe_places",
    "take_lease",
    "wait_for_leftovers",
    "join_launch",
    "tidy_root",
    "clear_run_places",
    "discard",
    "write_status",
    "clear_analysis",
    "write_record",
    "add_to_record",
    "start_run",
    "trained_keys",
    "write_artifacts",
    "referenced_keys",
    "analysis_problem",
    "fail_job",
    "source_snapshot",
    "write_snapshot",
    "copy_settings",
    "record_launch",
    "clean_up",
    "latest_training_digest",
    "verify_records",
]

HISTORY_SLOTS = 3
ANALYSIS_FILES = ("analysis.json", "metrics.json", "metrics", "plots", "timings.json")
NNPD_ENTRIES = (
    "cache",
    "scratch",
    "runs",
    "locks",
    "source",
    "damaged",
    "history.json",
    "timings.json",
    "report",
    "settings_training.py",
    "settings_analysis.py",
    ROOT_MARKER,
)
OWN_FOLDERS = ("cache", "scratch", "runs", "locks", "source", "damaged", "report")
LEASE, WORKERS = "launch", "workers"  # lock names of the root's lease
SNAPSHOT = re.compile(r"[0-9a-f]{16}\.zip")
VARIANT = re.compile(r".+-[0-9a-f]{10}")  # a configuration folder's name ends with its digest


def warn(message):
    """One warning line on stderr."""
    print(f"nnpd: warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- reading what may be damaged


def read_json(path, default=None):
    """A JSON file's content; `default` when it is missing, unreadable or not a JSON object/list like default."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as error:
        warn(f"{path} is unreadable ({type(error).__name__}); treating it as absent, so that step is redone")
        return default
    if default is not None and not isinstance(value, type(default)):
        warn(f"{path} does not hold a JSON {type(default).__name__}; treating it as absent, so that step is redone")
        return default
    return value


# ---------------------------------------------------------------- ownership and the lease


def refuse_wrong_root(root):
    """Refuse roots that are surely a mistake: the filesystem root, the home folder, a file."""
    resolved = root.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        what = "your home folder" if resolved == Path.home().resolve() else "the filesystem's root"
        raise LaunchError(
            f'output.root {str(root)!r} is {resolved}, {what}; choose a folder of its own, e.g. "outputs/<profile>"'
        )
    if root.exists() and not root.is_dir():
        raise LaunchError(f"output.root {str(root)!r} exists and is not a folder; choose a folder of its own")


def owns_root(root):
    """Whether the output root carries nnpd's marker; a wrong root, or a non-empty folder without it, is refused.

    Writes nothing, so `plan` and `verify` check a root as a launch does.
    """
    refuse_wrong_root(root)
    marker = root / ROOT_MARKER
    if marker.is_file() and not marker.is_symlink():
        return True
    if root.is_dir() and any(root.iterdir()):
        raise LaunchError(
            f"output.root {str(root)!r} is a folder nnpd did not create (no {ROOT_MARKER} "
            f"marker) and is not empty; choose a new or empty folder (an output root of an "
            f"earlier nnpd release: create the marker with `touch {marker}`)"
        )
    return False


def root_errors(root):
    """What a launch would refuse about the output root (for `plan`), found leaving nothing behind."""
    try:
        owns_root(root)
        check_creatable(root)
    except LaunchError as error:
        return [str(error)]
    return []


def check_creatable(root):
    """A root that does not exist yet must be one a launch can create: a folder made and removed at once
    in its nearest existing ancestor says so (permissions alone do not: root may write nowhere in /proc)."""
    if root.exists():
        return
    ancestor = next(place for place in root.absolute().parents if place.exists())
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(f"{ancestor} is not a folder")
        os.rmdir(tempfile.mkdtemp(prefix=".nnpd-probe-", dir=ancestor))
    except OSError as error:
        raise LaunchError(
            f"output.root {str(root)!r} cannot be created ({error.strerror or error}); choose a folder you can write"
        ) from None


def claim_root(root, create):
    """Check that nnpd owns the output root, creating it (with its marker) when `create` and it is new."""
    if owns_root(root):
        return
    marker = root / ROOT_MARKER
    if not create:
        raise LaunchError(f"{root}: nothing trained yet; run train first")
    if root.is_dir():
        write_json_atomic(marker, {"created": now_iso(), "by": "nnpd"})
        return
    # A new root appears at once with its marker, so a launch starting beside this one
    # never sees it half made.
    check_creatable(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    building = root.with_name(f".{root.name}.tmp-{os.getpid()}-{time.time_ns():x}")
    write_json_atomic(building / ROOT_MARKER, {"created": now_iso(), "by": "nnpd"})
    try:
        os.rename(building, root)
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
        claim_root(root, create)  # someone else made it meanwhile: check theirs


def refuse_links(root):
    """Refuse symbolic links where nnpd reads, writes or deletes: its own entries and two levels below its folders."""
    places = [root / name for name in NNPD_ENTRIES]
    for folder in ("runs", "cache", "scratch", "locks", "damaged"):
        for entry in _children(root / folder):
            places += [entry] + _children(entry)
    for place in places:
        refuse_link(place)


def refuse_unsafe_places(root):
    """Before anything is written: refuse links (refuse_links) and files where nnpd keeps its folders."""
    refuse_links(root)
    for folder in OWN_FOLDERS:
        own_folder(root / folder)
    for folder in ("cache", "scratch", "damaged"):  # their entries are folders too
        for entry in _children(root / folder):
            own_folder(entry)


def _children(folder):
    """Entries of a real folder (none for a link or a missing folder)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(folder.iterdir())


def wait_for_lock(store, name, shared, minutes, waiting_message):
    """Hold a lock on the root (close the returned stack to release it), saying once that we wait."""
    deadline = time.monotonic() + 60 * minutes
    while True:
        held = contextlib.ExitStack()
        if held.enter_context(store.lock(name, blocking=False, shared=shared)):
            return held
        held.close()
        if waiting_message:
            print(f"nnpd: {waiting_message}", file=sys.stderr, flush=True)
            waiting_message = None
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{store.root}: still in use after {minutes:g} minutes (runtime.timeout_minutes); "
                "wait for the other launch to end, or use another output.root"
            )
        time.sleep(0.5)


def take_lease(store, minutes):
    """Rank 0: hold the root's lease, so one launch at a time works here; wait for a running one."""
    return wait_for_lock(
        store, LEASE, False, minutes, f"another launch is using {store.root}; waiting for it to end (Ctrl-C to stop)"
    )


def wait_for_leftovers(store, minutes):
    """Rank 0 under its lease: wait until no worker of an earlier launch is still alive."""
    wait_for_lock(
        store,
        WORKERS,
        False,
        minutes,
        f"workers of an earlier launch still run in {store.root}; waiting for them to stop",
    ).close()


def join_launch(store, minutes):
    """Every worker: a shared hold that tells later launches a worker of this one is alive."""
    return wait_for_lock(store, WORKERS, True, minutes, None)


def tidy_root(root, store):
    """Remove leftovers of killed launches (rank 0, holding the lease, before any worker starts)."""
    store.tidy(keep_locks=(LEASE, WORKERS))
    for entry in _children(root / "runs"):
        for run in _children(entry):
            if run.name.startswith(".trash-"):
                shutil.rmtree(run, ignore_errors=True)
    for path in _children(root / "source"):
        if path.name.startswith(".") and ".tmp-" in path.name:
            path.unlink(missing_ok=True)
    for states in _children(root / "scratch"):
        for state in _children(states):
            if (root / "cache" / states.name / state.stem / "artifact.json").is_file():
                state.unlink()  # its artifact was committed after all
    for marks in _children(root / "locks"):
        if marks.name.startswith("launch-") and marks.is_dir():
            shutil.rmtree(marks, ignore_errors=True)  # marker folders of launches that died
    for folder in _atomic_write_folders(root):
        for path in _children(folder):
            if (
                ATOMIC_LEFTOVER.fullmatch(path.name)
                and path.is_file()
                and not path.is_symlink()
                and not _writer_alive(path.name)
            ):
                path.unlink(missing_ok=True)  # the temporary file of a write that was killed


def _writer_alive(leftover):
    """Whether the process a temporary file's name holds still runs here (`report` writes without the lease)."""
    pid = int(leftover.rsplit("-", 2)[1])
    if pid in (0, os.getpid()):
        return False  # 0 would signal our whole process group
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # it runs, as another user
    return True


def _atomic_write_folders(root):
    """The folders outside cache/ and source/ that nnpd writes files into through write_bytes_atomic."""
    folders = [root, root / "report"] + _children(root / "scratch")
    for variant in _children(root / "runs"):
        folders.append(variant)
        for run in _children(variant):  # run folders and the cohort's plots/
            folders += [run, run / "metrics", run / "plots"]
    return folders


# ---------------------------------------------------------------- run folders


def clear_run_places(root, store, runs, repair):
    """Make room for the planned run folders: a file where one (or its configuration folder) belongs.

    Such a place is nnpd's own, so when `repair` (train, run) the file is moved to damaged/
    and the run is redone; analyze, which cannot redo a training, refuses it in one line.
    """
    for run in runs:
        for place in (root / Path(run).parent, root / run):
            if place.is_dir() or not os.path.lexists(place) or place.is_symlink():
                continue  # a link was refused before (refuse_links)
            if not repair:
                raise LaunchError(
                    f"{place} is a file where the run folder of {run} belongs; run train to make the run folder again"
                )
            store.move_aside(
                place,
                "records",
                "a file stands where a run folder belongs",
                then="the run is redone",
                name=str(place.relative_to(root)).replace("/", "__"),
            )


def discard(path):
    """Delete a folder so that a crash half-way never leaves it looking valid: rename, then remove."""
    if path.is_symlink():
        raise LaunchError(f"{path} is a symbolic link; nnpd never follows links inside its output root")
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.time_ns():x}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return  # already gone
    shutil.rmtree(trash)


def write_status(run_dir, state, **extra):
    """Atomically record a run's training state."""
    write_json_atomic(run_dir / "status.json", {"state": state, "time": now_iso(), **extra})


def clear_analysis(run_dir):
    """Remove a run's analysis results, so none outlives the analysis that made it."""
    for name in ANALYSIS_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            discard(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def write_record(path, record):
    """Atomically write one of nnpd's JSON records (run.json, analysis.json) with its checksum."""
    record = {key: value for key, value in record.items() if key != "checksum"}
    write_json_atomic(path, {**record, "checksum": record_checksum(record)})


def add_to_record(path, **fields):
    """Add fields to a checksummed record (run.json) that nnpd wrote earlier, keeping its checksum true."""
    write_record(path, {**read_json(path, {}), **fields})


def start_run(root, run, record, worker):
    """Create the run folder with run.json (with its checksum) and a `running` status; clear old analysis."""
    run_dir = root / run
    write_record(run_dir / "run.json", {"id": run, **record, "started": now_iso()})
    clear_analysis(run_dir)
    plots = run_dir.parent / "plots"
    if plots.exists():
        discard(plots)  # the cohort's figures no longer describe its models
    write_status(run_dir, "running", worker=worker)


def trained_keys(run_dir):
    """(data key, model key) of a run whose status and artifacts agree that it is trained, else None."""
    status = read_json(run_dir / "status.json", {})
    used = read_json(run_dir / "artifacts.json", {})
    record = read_json(run_dir / "run.json", {})
    model, data = status.get("model"), status.get("data")
    if record and record.get("checksum") != record_checksum(record):
        warn(f"{run_dir / 'run.json'} does not match its checksum; writing it again")
        return None
    if (
        not record
        or status.get("state") != "trained"
        or not model
        or Path(str(used.get("model"))).name != model
        or Path(str(used.get("training-data"))).name != data
    ):
        return None
    return data, model


def write_artifacts(root, run_dir, used):
    """Record relative references to every artifact a run used."""
    write_json_atomic(
        run_dir / "artifacts.json",
        {name: str(Path(artifact.path).relative_to(root)) for name, artifact in used.items()},
    )


def referenced_artifacts(run_dir):
    """(name, key) of every artifact a run folder's artifacts.json refers to, by the run's own names."""
    references = read_json(run_dir / "artifacts.json", {})
    return {used: (Path(str(path)).parent.name, Path(str(path)).name) for used, path in references.items()}


def referenced_keys(root, runs):
    """Keys of every artifact the given run folders refer to: clean-up must keep them."""
    return {key for run in runs for _, key in referenced_artifacts(root / run).values()}


def missing_references(store, run_dir):
    """What a run folder refers to that is not committed intact in the store, as `cache/<name>/<key>` lines."""
    missing = []
    for name, key in referenced_artifacts(run_dir).values():
        try:
            found = store.find(name, key)
        except (DamagedArtifact, ValueError):
            found = None
        if found is None:
            missing.append(f"cache/{name}/{key}")
    return missing


def analysis_problem(store, run_dir):
    """Why a run's analysis is not complete and intact (None when it is): its records, metrics and products.

    An analysis counts as complete only while analysis.json is sound, metrics.json is what
    it wrote, and every artifact artifacts.json names is committed and intact.
    """
    done = read_json(run_dir / "analysis.json", {})
    if done.get("state") != "complete":
        return f"its state is {done.get('state', 'none')}"
    if done.get("checksum") != record_checksum(done):
        return "analysis.json does not match its checksum"
    metrics = read_json(run_dir / "metrics.json", {})
    if digest(metrics) != done.get("metrics"):
        return "metrics.json is not what the analysis wrote"
    for name, value in metrics.items():
        path = run_dir / "metrics" / f"{name}.json"
        if not path.is_file() or read_json(path) != value:
            return f"metrics/{name}.json is not what the analysis wrote"
    if sorted(key for _, key in referenced_artifacts(run_dir).values()) != sorted(done.get("artifacts", [])):
        return "artifacts.json disagrees with analysis.json"
    missing = missing_references(store, run_dir)
    if missing:
        return f"{missing[0]} is missing or damaged"
    return None


def fail_job(run_dir, stage, error):
    """Record a failed job's traceback in its status (training) or analysis.json."""
    text = "".join(traceback.format_exception(error))
    if stage == "train":
        write_status(run_dir, "failed", error=str(error), traceback=text)
    else:
        previous = read_json(run_dir / "analysis.json", {})
        write_record(
            run_dir / "analysis.json",
            {**previous, "state": "failed", "error": str(error), "traceback": text, "time": now_iso()},
        )


def is_own_run(root, path):
    """Whether a folder under runs/ is a run folder nnpd wrote there (its run.json names this very path)."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        record = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("id") == str(path.relative_to(root))


# ---------------------------------------------------------------- source snapshot and settings copies


def code_files(code_dir):
    """nnpd's own modules: those of the source tree, or of the installed package (not all of site-packages)."""
    code_dir = Path(code_dir)
    if (code_dir / "pyproject.toml").is_file():
        return sorted(code_dir.glob("*.py"))
    try:
        installed = importlib.metadata.files("nnpd") or []
    except importlib.metadata.PackageNotFoundError:
        installed = []
    found = sorted(code_dir / path.name for path in installed if path.suffix == ".py" and len(path.parts) == 1)
    return found or sorted(code_dir.glob("*.py"))


def source_snapshot(code_dir, training_path, analysis_path):
    """A deterministic zip of the code and the settings files, and its content hash."""
    files = code_files(code_dir) + [training_path, analysis_path]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for index, path in enumerate(files):
            name = path.name if index < len(files) - 2 else f"settings/{path.name}"
            archive.writestr(zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0)), path.read_bytes())
    data = buffer.getvalue()
    return hashlib.sha256(data).hexdigest()[:16], data


def write_snapshot(root, code_dir, profile):
    """Store the source snapshot under source/ and return its path relative to the root."""
    name, data = source_snapshot(code_dir, profile.training_path, profile.analysis_path)
    target = root / "source" / f"{name}.zip"
    if not target.exists():
        write_bytes_atomic(target, data)
    return f"source/{name}.zip"


def copy_settings(root, profile):
    """Byte copies of the settings files this launch started from."""
    for source in (profile.training_path, profile.analysis_path):
        target = root / source.name
        if source.resolve() != target.resolve():
            write_bytes_atomic(target, source.read_bytes())


# ---------------------------------------------------------------- history: latest settings win


def read_history(root):
    """history.json's entries (none yet when it is missing), rebuilt from the run folders when damaged."""
    if not (root / "history.json").exists():
        return []
    entries = read_json(root / "history.json", {}).get("trainings")
    if isinstance(entries, list) and all(_sound_entry(entry) for entry in entries):
        return entries
    warn(f"{root / 'history.json'} is not nnpd's history; rebuilding it from the run folders")
    return _rebuilt_history(root)


def _sound_entry(entry):
    """Whether a history entry has the fields clean-up relies on."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("digest"), str)
        and isinstance(entry.get("runs"), list)
        and isinstance(entry.get("backends"), dict)
        and isinstance(entry.get("source"), str)
        and all(isinstance(b, dict) and isinstance(b.get("artifacts"), list) for b in entry["backends"].values())
    )


def _rebuilt_history(root):
    """One entry keeping everything the existing run folders use, so nothing in use is deleted."""
    runs = [path for entry in _children(root / "runs") for path in _children(entry) if is_own_run(root, path)]
    if not runs:
        return []
    artifacts = sorted(
        {Path(str(reference)).name for run in runs for reference in read_json(run / "artifacts.json", {}).values()}
    )
    sources = sorted({str(read_json(run / "run.json", {}).get("source")) for run in runs})
    return [
        {
            "digest": "rebuilt",
            "time": now_iso(),
            "runs": [str(run.relative_to(root)) for run in runs],
            "source": sources[0],
            "sources": sources,
            "backends": {"rebuilt": {"artifacts": artifacts}},
        }
    ]


def record_launch(root, entry_fields, backend, used_keys, replace):
    """Put what this launch used in its (training, backend) history entry, newest first; return the history.

    Slots count distinct trainings (HISTORY_SLOTS): settings, and the content of the files they
    name (`files`, a bank's, absent without one); within one, every backend's artifacts are kept,
    so switching between CPU and GPU, or jobs and DDP, loses no model. A training launch
    replaces its backend's list; an analysis adds its products to it.
    """
    entries = read_history(root)
    mine = next((entry for entry in entries if _same_training(entry, entry_fields)), None)
    others = [entry for entry in entries if entry is not mine]
    backends = dict(mine["backends"]) if mine else {}
    known = set() if replace else set(backends.get(backend["digest"], {}).get("artifacts", []))
    backends[backend["digest"]] = {
        "identity": backend["identity"],
        "time": now_iso(),
        "artifacts": sorted(known | set(used_keys)),
    }
    runs = entry_fields["runs"] if replace or not mine else mine["runs"]
    entry = {**(mine or {}), **entry_fields, "runs": runs, "backends": backends, "time": now_iso()}
    entries = [entry] + others[: HISTORY_SLOTS - 1]
    write_json_atomic(root / "history.json", {"trainings": entries})
    return entries


def _same_training(entry, entry_fields):
    """Whether a history entry is the training of these fields: the same settings on the same files."""
    return entry["digest"] == entry_fields["digest"] and entry.get("files") == entry_fields.get("files")


def kept_artifacts(entries):
    """Keys of every artifact some kept training uses, on any backend."""
    return {key for entry in entries for backend in entry["backends"].values() for key in backend["artifacts"]}


def clean_up(root, store, runs, entries):
    """Keep this launch's runs and what the kept trainings use; delete only what nnpd made."""
    for variant in _children(root / "runs"):
        if not variant.is_dir():
            continue
        for run in _children(variant):
            if run.name != "plots" and str(run.relative_to(root)) not in runs:
                if is_own_run(root, run) or run.name.startswith(".trash-"):
                    discard(run)
                else:
                    warn(f"left alone: {run} (not a run folder nnpd made)")
        rest = [path for path in _children(variant) if path.name != "plots"]
        if not rest and VARIANT.fullmatch(variant.name):
            if (variant / "plots").exists():
                discard(variant / "plots")  # a configuration no longer trained, with its cohort figures
            variant.rmdir()
    store.prune(kept_artifacts(entries))
    sources = {source for entry in entries for source in entry.get("sources", [entry["source"]])}
    for path in _children(root / "source"):
        if SNAPSHOT.fullmatch(path.name) and f"source/{path.name}" not in sources:
            path.unlink()  # older snapshots


def latest_training_digest(root):
    """The digest of the output root's latest training, or None."""
    entries = read_history(root)
    return entries[0]["digest"] if entries else None


# ---------------------------------------------------------------- verify: the root's own records

RUN_RECORDS = ("run.json", "status.json", "artifacts.json", "analysis.json", "metrics.json")
CHECKSUMMED = ("run.json", "analysis.json")


def record_problem(path):
    """Why a JSON record of nnpd's is damaged, or None when it reads as an object that agrees with its checksum.

    run.json and analysis.json carry their own checksum; metrics.json must be what its
    analysis.json says was written.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"unreadable ({type(error).__name__})"
    if not isinstance(value, dict):
        return "not a JSON object"
    if path.name in CHECKSUMMED and value.get("checksum") != record_checksum(value):
        return "its checksum does not match"
    if path.name == "metrics.json":
        written = read_json(path.parent / "analysis.json", {}).get("metrics")
        if written is not None and digest(value) != written:
            return "it is not what its analysis wrote"
    return None


def verify_records(root, store):
    """Check the run folders' JSON records, what they refer to, and history.json; return what is damaged.

    Damaged records are moved aside; an artifact a run refers to that is missing from the
    store (pruned, or moved aside as damaged) is reported, and the next launch rebuilds it.
    """
    damaged = []
    folders = [
        run
        for variant in _children(root / "runs")
        for run in _children(variant)
        if run.name != "plots" and run.is_dir()
    ]
    # metrics.json is judged by its analysis.json, so it goes first: a damaged analysis.json leaves with it.
    records = [root / "history.json"] + [run / name for run in folders for name in reversed(RUN_RECORDS)]
    for path in records:
        if path.is_file() and not path.is_symlink():
            problem = record_problem(path)
            if problem:
                damaged.append(str(path))
                name = str(path.relative_to(root)).replace("/", "__")
                store.move_aside(path, "records", problem, then="the next launch redoes that step", name=name)
    for run in folders:
        damaged += [
            f"{run / 'artifacts.json'}: {missing} is missing (the next launch rebuilds it)"
            for missing in missing_references(store, run)
        ]
    return damaged
