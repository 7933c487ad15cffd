"""nnpd: command line and orchestration of neural-ratio-estimation studies.

    python nnpd.py [plan|train|analyze|run|verify] [--profile NAME] [--settings-dir DIR]

`plan` (the default) only resolves and validates; `train` stops at committed weights;
`analyze` analyses the trained models and never trains; `run` does both per job;
`verify` recomputes every checksum in the profile's store. The same command works
under `torchrun`, with workers taking disjoint jobs (`runtime.parallel="jobs"`) or
training each model together (`runtime.parallel="ddp"`).
"""
import argparse
import datetime
import hashlib
import io
import json
import os
import shutil
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

import runtime
import study
import sweep
from store import DamagedArtifact, Store, write_bytes_atomic, write_json_atomic
from sweep import SettingsError

ACTIONS = ("plan", "train", "analyze", "run", "verify")
HISTORY_SLOTS = 3
CODE_DIR = Path(__file__).resolve().parent
ANALYSIS_FILES = ("analysis.json", "metrics.json", "metrics", "plots")


class LaunchError(RuntimeError):
    """A launch cannot go on for a reason the user can fix; the message says how."""


@dataclass
class Job:
    """One trained model: a configuration times a cohort member."""
    configuration: object
    member: dict
    experiment: object
    analysis: object
    analysis_workload: dict

    @property
    def settings(self):
        """The configuration's resolved training settings."""
        return self.configuration.settings

    @property
    def run(self):
        """The run folder relative to the output root."""
        tag = sweep.digest({"configuration": self.configuration.digest, "member": self.member})[:10]
        return f"runs/{self.configuration.name}/{self.member['name']}-{tag}"


def now():
    """The current UTC time as ISO text."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_json(path, default=None):
    """A JSON file's content, or `default` when it does not exist."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return default


# ---------------------------------------------------------------- planning

def default_settings_dir():
    """The current directory when it holds settings files, else the code's directory."""
    here = Path.cwd()
    return here if (here / "settings_training.py").exists() else CODE_DIR


def load(profile=None, settings_dir=None):
    """The profile's settings, loaded and structurally validated."""
    return sweep.load_profile(Path(settings_dir) if settings_dir else default_settings_dir(), profile)


def check_launch_settings(settings):
    """The sections the framework itself reads: the output root and the seed."""
    root = settings["output"].get("root") if isinstance(settings["output"], dict) else None
    if not isinstance(root, str) or not root:
        raise SettingsError("output.root: expected a non-empty path, e.g. \"outputs/<profile>\"")
    if not sweep.is_integer(settings["seed"]):
        raise SettingsError(f"seed: expected an integer, got {settings['seed']!r}")


def configuration_jobs(configuration, analysis_settings):
    """Validate one configuration and list its jobs."""
    settings = configuration.settings
    check_launch_settings(settings)
    experiment = study.load_class(settings["experiment"], "experiment")(settings)
    experiment.validate()
    analysis = study.load_class(analysis_settings["analysis"], "analysis")(analysis_settings, experiment)
    study.check_graph(analysis.products, analysis.metrics, list(analysis_settings["metrics"]))
    analysis.validate()
    return [Job(configuration, member, experiment, analysis, analysis.workload(member))
            for member in experiment.members()]


def workload_errors(job, limits):
    """Messages for every analysis limit this job's estimate exceeds."""
    checks = (("model_evaluations", "max_model_evaluations"), ("saved_bytes", "max_saved_bytes"),
              ("candidate_points", "max_candidate_points"))
    return [f"configuration {job.configuration.name} member {job.member['name']}: the analysis needs "
            f"{job.analysis_workload[need]:.3g} {need.replace('_', ' ')}, over verification.{limit}="
            f"{limits[limit]:.3g}; reduce inference.truths, inference.candidates or "
            f"inference.observations in settings_analysis.py, or raise the limit"
            for need, limit in checks if job.analysis_workload[need] > limits[limit]]


def check_limits(limits):
    """The analysis limits must be positive numbers."""
    for name in ("max_model_evaluations", "max_saved_bytes", "max_candidate_points"):
        value = limits.get(name)
        if not sweep.is_number(value) or not value > 0:
            raise SettingsError(f"verification.{name}: expected a positive number, got {value!r}")


PLOT_FORMATS = ("png", "pdf", "svg")


def check_plotting(plotting):
    """The figure format and resolution, when given."""
    if plotting.get("format", "png") not in PLOT_FORMATS:
        raise SettingsError(f"plotting.format: {plotting['format']!r} is not one of {', '.join(PLOT_FORMATS)}")
    dpi = plotting.get("dpi", 120)
    if not sweep.is_integer(dpi) or dpi < 1:
        raise SettingsError(f"plotting.dpi: expected a positive integer, got {dpi!r}")


def matplotlib_missing():
    """Whether figures cannot be drawn here (matplotlib is an optional extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


@dataclass
class Plan:
    """Every job of a launch and what stands in its way."""
    jobs: list
    errors: list            # stop every stage
    analysis_errors: list   # stop analyze and run (workload over the limits)
    warnings: list


def make_plan(profile):
    """Validate every configuration and member before anything is computed."""
    jobs, errors, analysis_errors, warnings = [], [], [], []
    check_limits(profile.analysis["verification"])
    check_plotting(profile.analysis["plotting"])
    if (profile.analysis["plots"] or profile.analysis["cohort_plots"]) and matplotlib_missing():
        warnings.append("plots/cohort_plots: figures were requested but matplotlib is not installed, so they are "
                        "skipped; install it with `pip install matplotlib` (the package's [plots] extra)")
    for configuration in profile.configurations:
        try:
            found = configuration_jobs(configuration, profile.analysis)
        except SettingsError as error:
            errors.append(f"configuration {configuration.name}: {error}")
            continue
        jobs.extend(found)
        for job in found:
            analysis_errors.extend(workload_errors(job, profile.analysis["verification"]))
    runs = [job.run for job in jobs]
    repeated = sorted({run for run in runs if runs.count(run) > 1})
    if repeated:
        errors.append(f"cohort: two members share the run folder {repeated[0]}; cohort members must be distinct")
    runtime_settings = profile.configurations[0].settings["runtime"]
    try:
        runtime.check_runtime_settings(runtime_settings)
        rank, world, local_rank = runtime.launch_environment()
        device = runtime.resolve_device(runtime_settings["device"], local_rank, world)
        for configuration in profile.configurations:
            runtime.check_precision(configuration.settings["training"]["precision"], device)
        if runtime_settings.get("parallel") == "ddp" and world == 1:
            warnings.append("runtime.parallel=\"ddp\" in a single process trains as one process; launch with "
                            "torchrun --nproc_per_node=N for collective training")
    except SettingsError as error:
        errors.append(str(error))
    return Plan(jobs, errors, analysis_errors, warnings)


def plan_report(profile, plan):
    """The plan as a JSON-able dict."""
    configurations = []
    for configuration in profile.configurations:
        mine = [job for job in plan.jobs if job.configuration is configuration]
        configurations.append({
            "name": configuration.name, "variant": configuration.variant, "knob": configuration.knob,
            "value": configuration.value,
            "input_size": mine[0].experiment.input_size() if mine else None,
            "jobs": [{"run": job.run, "member": job.member["name"],
                      "workload": {**job.experiment.workload(job.member), **job.analysis_workload}}
                     for job in mine],
        })
    return {"profile": profile.name, "settings_dir": str(profile.settings_dir),
            "output_root": profile.training["output"].get("root"), "configurations": configurations,
            "jobs": len(plan.jobs), "warnings": plan.warnings, "errors": plan.errors + plan.analysis_errors}


def plan(profile=None, settings_dir=None):
    """Resolve and validate every configuration and member; compute and write nothing."""
    loaded = load(profile, settings_dir)
    return plan_report(loaded, make_plan(loaded))


# ---------------------------------------------------------------- launch bookkeeping

def training_identity(profile):
    """The digest that tells distinct training settings apart in history.json."""
    return sweep.digest(sweep.to_jsonable(profile.training))


def source_snapshot(profile):
    """A deterministic zip of the code and the settings files, and its content hash."""
    files = sorted(CODE_DIR.glob("*.py")) + [profile.training_path, profile.analysis_path]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for index, path in enumerate(files):
            name = path.name if index < len(files) - 2 else f"settings/{path.name}"
            archive.writestr(zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0)), path.read_bytes())
    data = buffer.getvalue()
    return hashlib.sha256(data).hexdigest()[:16], data


def write_snapshot(root, profile):
    """Store the source snapshot under source/ and return its path relative to the root."""
    name, data = source_snapshot(profile)
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


def discard(path):
    """Delete a folder so that a crash half-way never leaves it looking valid: rename, then remove."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.time_ns():x}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return                            # already gone (or taken by another worker)
    shutil.rmtree(trash)


def run_artifacts(root, runs):
    """Store keys referenced by the given run folders' artifacts.json."""
    keys = set()
    for run in runs:
        for reference in read_json(root / run / "artifacts.json", {}).values():
            keys.add(Path(reference).name)
    return keys


def record_history(root, profile, runs, snapshot):
    """Put this training first in history.json, keeping the last three distinct settings."""
    identity = training_identity(profile)
    history = read_json(root / "history.json", {"trainings": []})
    entries = [entry for entry in history["trainings"] if entry["digest"] != identity]
    entry = {"digest": identity, "profile": profile.name, "time": now(), "runs": sorted(runs),
             "artifacts": sorted(run_artifacts(root, runs)), "source": snapshot,
             "settings": sweep.to_jsonable(profile.training)}
    history["trainings"] = [entry] + entries[:HISTORY_SLOTS - 1]
    write_json_atomic(root / "history.json", history)
    return history


def clean_up(root, store, profile, runs, snapshot):
    """Latest settings win: keep this launch's runs and what the last three trainings use."""
    for variant in (root / "runs").glob("*"):
        for run in variant.glob("*"):
            if run.name.startswith(".trash-"):
                shutil.rmtree(run)        # left by an interrupted clean-up
            elif run.name != "plots" and str(run.relative_to(root)) not in runs:
                discard(run)
        if not any(path.name != "plots" for path in variant.iterdir()):
            shutil.rmtree(variant)        # a configuration no longer trained, with its cohort figures
    copy_settings(root, profile)
    history = record_history(root, profile, runs, snapshot)
    store.prune(set().union(*(entry["artifacts"] for entry in history["trainings"])))
    sources = {entry["source"] for entry in history["trainings"]}
    for path in (root / "source").iterdir():
        if f"source/{path.name}" not in sources:
            path.unlink()     # older snapshots and temporary files of interrupted writes


def record_analysis(root, profile, runs):
    """Add the products an analysis used to its training's history entry, so they are kept."""
    history = read_json(root / "history.json", {"trainings": []})
    for entry in history["trainings"]:
        if entry["digest"] == training_identity(profile):
            entry["artifacts"] = sorted(set(entry["artifacts"]) | run_artifacts(root, runs))
            write_json_atomic(root / "history.json", history)
    copy_settings(root, profile)


@dataclass
class Launch:
    """What every job of one launch shares: where it writes, how it runs, who it is."""
    stage: str
    profile: object
    root: Path
    store: Store
    rt: object
    identity: dict
    snapshot: str = ""
    id: str = ""
    waits: int = 0

    @property
    def owner(self):
        """Whether this worker writes the folders of the jobs it runs (in ddp only rank 0)."""
        return self.rt.is_main or not self.rt.ddp

    def log(self, message):
        """Progress, printed by rank 0 only."""
        if self.rt.is_main:
            print(f"[nnpd {time.strftime('%H:%M:%S')}] {message}", flush=True)

    @property
    def marks(self):
        """The folder where workers mark the points they reached."""
        return self.root / "locks" / f"launch-{self.id}"

    def wait_for_workers(self, step):
        """Wait until every worker has reached `step`.

        Where one worker may wait long (others still training, rank 0 analysing), a
        collective would hit the process-group timeout; marker files on the shared
        output root have none. A worker that dies ends the launch through torchrun.
        """
        if not self.rt.distributed:
            return
        self.waits += 1
        name = f"{self.waits}-{step}"
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / f"{name}-{self.rt.rank}").touch()
        while not all((self.marks / f"{name}-{rank}").exists() for rank in range(self.rt.world_size)):
            time.sleep(0.2)


def draw_figures(figures, selected, target, folder, plotting):
    """Draw the selected figures into folder, each written atomically; skipped without matplotlib."""
    if not selected or matplotlib_missing():
        return
    from matplotlib.figure import Figure   # no pyplot: no global state, nothing left open

    fmt, dpi = plotting.get("format", "png"), plotting.get("dpi", 120)
    for name in selected:
        figure = Figure(figsize=(12, 7), layout="constrained")
        figures[name].draw(target, figure)
        buffer = io.BytesIO()
        figure.savefig(buffer, format=fmt, dpi=dpi)
        write_bytes_atomic(folder / f"{name}.{fmt}", buffer.getvalue())


def cohort_figures(launch, jobs, trained):
    """Per configuration, the cohort figures across its members (rank 0, after every job)."""
    settings = launch.profile.analysis
    if not settings["cohort_plots"]:
        return
    for configuration in launch.profile.configurations:
        members = [job for job in jobs if job.configuration is configuration]
        if not members:
            continue
        contexts = [study.Context(job.settings, settings, job.member, job.experiment, job.analysis, launch.rt,
                                  launch.root / job.run, launch.store,
                                  *(trained.get(job.run) or trained_artifacts(launch, job))) for job in members]
        folder = launch.root / "runs" / configuration.name / "plots"
        discard(folder)                   # figures no longer selected do not linger
        launch.log(f"figures {configuration.name}")
        draw_figures(members[0].analysis.cohort_plots, settings["cohort_plots"], contexts, folder,
                     settings["plotting"])


# ---------------------------------------------------------------- jobs

def write_status(run_dir, state, **extra):
    """Atomically record a run's training state."""
    write_json_atomic(run_dir / "status.json", {"state": state, "time": now(), **extra})


def data_recipe(job):
    """The training data's recipe: no backend identity, so CPU and CUDA share data."""
    return {"experiment": job.experiment.data_recipe(job.member),
            "source": study.source_fingerprint(type(job.experiment), *job.experiment.DATA_SOURCES),
            "versions": study.library_versions()}


def model_recipe(job, data_key, identity):
    """The model's recipe: settings, data, source, versions and backend identity."""
    return {"experiment": job.experiment.model_recipe(job.member), "data": data_key, "backend": identity,
            "source": study.source_fingerprint(type(job.experiment), *job.experiment.MODEL_SOURCES),
            "versions": study.library_versions()}


def reference(root, artifact):
    """A reference to an artifact relative to the output root."""
    return str(Path(artifact.path).relative_to(root))


def clear_analysis(run_dir):
    """Remove a run's analysis results, so none outlives the analysis that made it."""
    for name in ANALYSIS_FILES:
        path = run_dir / name
        if path.is_dir():
            discard(path)
        elif path.exists():
            path.unlink()


def start_run(launch, job):
    """Create the run folder with run.json and a `running` status; clear old analysis."""
    run_dir = launch.root / job.run
    write_json_atomic(run_dir / "run.json", {
        "id": job.run, "configuration": job.configuration.name, "variant": job.configuration.variant,
        "knob": job.configuration.knob, "value": job.configuration.value, "member": job.member,
        "settings": job.settings, "backend": launch.identity, "versions": study.library_versions(),
        "source": launch.snapshot, "started": now(), "description": job.experiment.describe(job.member)})
    clear_analysis(run_dir)
    discard(run_dir.parent / "plots")      # the cohort's figures no longer describe its models
    write_status(run_dir, "running", worker=launch.rt.rank)


def is_trained(run_dir, model_key):
    """Whether the run folder already records this exact model as trained."""
    status = read_json(run_dir / "status.json", {})
    return status.get("state") == "trained" and status.get("model") == model_key


def find_intact(store, name, key):
    """A committed, undamaged artifact, or None (a damaged one is rebuilt by `get`)."""
    try:
        return store.find(name, key)
    except DamagedArtifact:
        return None


def write_data(job, writer):
    """Build the training-data artifact."""
    arrays = job.experiment.sample_data(job.member)
    for name, array in arrays.items():
        writer.array(name, array)
    return {"rows": {name: int(array.shape[0]) for name, array in arrays.items() if name.endswith("_labels")}}


def write_model(writer, state, history):
    """Build the model artifact: weights plus the training history."""
    writer.weights(state)
    writer.json("history", history)
    return {"selected_epoch": history.get("selected_epoch"), "epochs": history.get("epochs")}


def train_job(launch, job):
    """Get or sample the data, then get or train the model; status becomes `trained`."""
    store, rt, run_dir = launch.store, launch.rt, launch.root / job.run
    recipe_of_data = data_recipe(job)
    recipe = model_recipe(job, store.key("training-data", recipe_of_data), launch.identity)
    current = launch.owner and is_trained(run_dir, store.key("model", recipe))
    if launch.owner and not current:
        start_run(launch, job)
    data = store.get("training-data", recipe_of_data, build=lambda writer: write_data(job, writer))

    def train_model():
        return job.experiment.train(job.member, job.experiment.build_model(job.member), data, rt)

    if not rt.ddp:
        model = store.get("model", recipe, build=lambda writer: write_model(writer, *train_model()))
    else:
        # Every rank must train together, so training cannot happen under the
        # artifact's lock; rank 0 decides whether it is needed and commits it.
        model = find_intact(store, "model", store.key("model", recipe)) if rt.is_main else None
        if not runtime.broadcast_object(rt, model is not None):
            state, history = train_model()
            if rt.is_main:
                model = store.get("model", recipe, build=lambda writer: write_model(writer, state, history))
        runtime.barrier(rt)
    if launch.owner and not current:
        write_json_atomic(run_dir / "artifacts.json", {"training-data": reference(launch.root, data),
                                                       "model": reference(launch.root, model)})
        write_status(run_dir, "trained", worker=rt.rank, model=model.key,
                     selected_epoch=model.metadata.get("selected_epoch"))
    return data, model


def trained_artifacts(launch, job):
    """The committed data and weights of a trained job, or an error saying to train."""
    store, run_dir = launch.store, launch.root / job.run
    fix = f"run `python nnpd.py train --profile {launch.profile.name}` first"
    status = read_json(run_dir / "status.json")
    if not status or status.get("state") != "trained":
        state = f"state {status['state']}" if status else "no run folder"
        raise LaunchError(f"{run_dir}: no trained model ({state}); {fix}")
    data_key = store.key("training-data", data_recipe(job))
    try:
        data = store.find("training-data", data_key)
        model = store.find("model", store.key("model", model_recipe(job, data_key, launch.identity)))
    except DamagedArtifact as error:
        raise LaunchError(f"{error}; {fix} to rebuild it") from None
    if data is None or model is None:
        raise LaunchError(f"{run_dir}: no model trained with this runtime ({launch.identity['device_type']}, "
                          f"DDP world size {launch.identity['ddp_world_size']}) is in the store; {fix}")
    return data, model


def analyze_job(launch, job, data, model):
    """Compute the selected metrics of one trained model, building products lazily."""
    run_dir = launch.root / job.run
    settings = job.analysis.settings
    done = read_json(run_dir / "analysis.json", {})
    if (done.get("state") == "complete" and done.get("model") == model.key and done.get("source") == launch.snapshot
            and done.get("settings") == settings and (run_dir / "metrics.json").exists()):
        return read_json(run_dir / "metrics.json")    # same model, code and settings: nothing to do
    clear_analysis(run_dir)
    record = {"settings": settings, "source": launch.snapshot, "model": model.key, "worker": launch.rt.rank}
    write_json_atomic(run_dir / "analysis.json", {"state": "running", **record, "time": now()})
    ctx = study.Context(job.settings, settings, job.member, job.experiment, job.analysis, launch.rt,
                        run_dir, launch.store, data, model)
    values = {}
    for name in settings["metrics"]:
        values[name] = job.analysis.metrics[name].compute(ctx)
        write_json_atomic(run_dir / "metrics" / f"{name}.json", values[name])
    write_json_atomic(run_dir / "metrics.json", values)
    draw_figures(job.analysis.plots, settings["plots"], ctx, run_dir / "plots", settings["plotting"])
    used = {"training-data": data, "model": model, **ctx.used}
    write_json_atomic(run_dir / "artifacts.json", {name: reference(launch.root, a) for name, a in used.items()})
    write_json_atomic(run_dir / "analysis.json", {"state": "complete", **record, "time": now()})
    return values


def fail_job(run_dir, stage, error):
    """Record a failed job's traceback in its status (training) or analysis.json."""
    text = "".join(traceback.format_exception(error))
    if stage == "train":
        write_status(run_dir, "failed", error=str(error), traceback=text)
    else:
        previous = read_json(run_dir / "analysis.json", {})
        write_json_atomic(run_dir / "analysis.json", {**previous, "state": "failed", "error": str(error),
                                                      "traceback": text, "time": now()})


# ---------------------------------------------------------------- execution

def job_cost(job):
    """A rough cost in multiply-adds, used to start the largest jobs first."""
    training = job.experiment.workload(job.member)
    examples = 3 * training["training_examples"] + job.analysis_workload["model_evaluations"]
    return examples * training["network_parameters"]


def claim_jobs(launch, jobs):
    """Yield this worker's jobs: all of them in ddp or alone, else the next unclaimed one.

    Workers claim the largest unclaimed job under a store lock whenever they are
    free, so they finish together when job costs differ. NNPD_ASSIGNMENT=round-robin
    (for benchmarks) gives worker r the fixed share jobs[r::world] instead.
    """
    rt = launch.rt
    if not rt.distributed or rt.ddp:
        yield from jobs
        return
    if os.environ.get("NNPD_ASSIGNMENT") == "round-robin":
        yield from jobs[rt.rank::rt.world_size]
        return
    order = sorted(range(len(jobs)), key=lambda i: -job_cost(jobs[i]))
    claims = launch.marks / "claims.json"
    while True:
        with launch.store.lock(f"claims-{launch.id}"):
            taken = read_json(claims, [])
            free = [i for i in order if i not in taken]
            if not free:
                return
            write_json_atomic(claims, taken + [free[0]])
        yield jobs[free[0]]


def do_job(launch, job, trained=None):
    """Run one job's stage(s); returns an error message or None."""
    run_dir = launch.root / job.run
    stage = "train"
    try:
        if launch.stage in ("train", "run"):
            launch.log(f"train   {job.run}")
            data, model = train_job(launch, job)
        else:
            data, model = trained
        if launch.stage in ("analyze", "run"):
            stage = "analyze"
            if launch.owner:
                launch.log(f"analyze {job.run}")
                analyze_job(launch, job, data, model)
            if launch.rt.ddp:
                launch.wait_for_workers("analysed")
        return None
    except LaunchError:
        raise
    except Exception as error:
        fail_job(run_dir, stage, error)
        where = run_dir / ("status.json" if stage == "train" else "analysis.json")
        message = f"{job.run}: {stage} failed on worker {launch.rt.rank}: {error} (traceback in {where})"
        if launch.rt.ddp:   # the other ranks cannot go on without this one: end the whole launch
            raise LaunchError(message) from error
        return message


def latest_training(profile):
    """For analyze: the profile with the training settings of the output root's latest training.

    When settings_training.py was edited after the last training, analysis still
    concerns the models that exist; the root keeps a byte copy of their settings.
    """
    root = Path(profile.training["output"]["root"])
    history = read_json(root / "history.json", {"trainings": []})
    if not history["trainings"] or history["trainings"][0]["digest"] == training_identity(profile) \
            or not (root / profile.training_path.name).exists():
        return profile
    latest = sweep.load_profile(profile.settings_dir, profile.name, training_dir=root)
    if runtime.launch_environment()[0] == 0:
        print(f"nnpd: {profile.training_path} differs from the latest training; analysing the latest "
              f"training (settings in {latest.training_path}); run train to train the edited settings",
              file=sys.stderr)
    return latest


def execute(stage, profile=None, settings_dir=None):
    """Train, analyze or run a profile; returns a summary dict. Raises on failure."""
    if stage not in ("train", "analyze", "run"):
        raise SettingsError(f"unknown stage {stage!r}; use train, analyze or run")
    loaded = load(profile, settings_dir)
    if stage == "analyze":
        loaded = latest_training(loaded)
    plan = make_plan(loaded)
    errors = plan.errors + (plan.analysis_errors if stage != "train" else [])
    if errors:
        raise SettingsError(errors[0])
    root = Path(loaded.training["output"]["root"])
    rt = runtime.start(loaded.configurations[0].settings["runtime"])
    try:
        launch = Launch(stage, loaded, root, Store(root), rt, runtime.backend_identity(rt))
        return run_launch(launch, plan.jobs)
    finally:
        runtime.stop(rt)


def run_launch(launch, jobs):
    """Run the stage over this worker's jobs, then clean up on rank 0 once all are done."""
    rt, root, profile = launch.rt, launch.root, launch.profile
    trained = {}
    if launch.stage == "analyze":   # check every model before anything is written
        if not (root / "runs").is_dir():
            raise LaunchError(f"{root}: nothing trained yet; run `python nnpd.py train --profile {profile.name}` first")
        trained = {job.run: trained_artifacts(launch, job) for job in jobs}
    snapshot = write_snapshot(root, profile) if rt.is_main else None
    launch.snapshot, launch.id = runtime.broadcast_object(rt, (snapshot, f"{time.time_ns():x}"))
    launch.log(f"{launch.stage} {profile.name}: {len(jobs)} jobs, device {rt.device}, {rt.world_size} worker(s), "
               f"parallel={rt.parallel}, output {root}")
    failures = []
    for job in claim_jobs(launch, jobs):
        failure = do_job(launch, job, trained.get(job.run))
        if failure:
            failures.append(failure)
            print(f"[nnpd rank {rt.rank}] {failure}", file=sys.stderr, flush=True)
    launch.wait_for_workers("jobs-done")
    failures = [f for part in runtime.all_gather_object(rt, failures) for f in part]
    if rt.is_main and not failures and launch.stage != "train":
        cohort_figures(launch, jobs, trained)
    if rt.is_main and not failures:
        with launch.store.lock("cleanup"):
            runs = {job.run for job in jobs}
            if launch.stage == "analyze":
                record_analysis(root, profile, runs)
            else:
                clean_up(root, launch.store, profile, runs, launch.snapshot)
    launch.wait_for_workers("cleaned-up")
    runtime.barrier(rt)   # everyone is past the marks: rank 0 removes them
    if rt.is_main and rt.distributed:
        shutil.rmtree(launch.marks, ignore_errors=True)
        (root / "locks" / f"claims-{launch.id}.lock").unlink(missing_ok=True)
    if failures:
        raise LaunchError(f"{len(failures)} job(s) failed; first: {failures[0]}")
    launch.log(f"{launch.stage} done: results in {root / 'runs'}")
    return {"stage": launch.stage, "profile": profile.name, "root": str(root), "runs": sorted(job.run for job in jobs)}


def verify(profile=None, settings_dir=None):
    """Recompute every checksum in the profile's store; returns a report dict."""
    loaded = load(profile, settings_dir)
    root = Path(loaded.training["output"]["root"])
    if not (root / "cache").is_dir():
        raise LaunchError(f"{root}: no store to verify; run `python nnpd.py train --profile {loaded.name}` first")
    checked, damaged = Store(root).verify()
    return {"root": str(root), "checked": checked, "damaged": damaged}


# ---------------------------------------------------------------- command line

def parse_arguments(argv):
    """The command line: an action, a profile and a settings directory."""
    parser = argparse.ArgumentParser(prog="nnpd", description=__doc__.split("\n")[0])
    parser.add_argument("action", nargs="?", default="plan", choices=ACTIONS)
    parser.add_argument("--profile", help="profile name (default: the settings file's DEFAULT_PROFILE)")
    parser.add_argument("--settings-dir", help="directory holding settings_training.py and settings_analysis.py")
    return parser.parse_args(argv)


def main(argv=None):
    """Run the command line; returns the exit status."""
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        if arguments.action == "plan":
            report = plan(arguments.profile, arguments.settings_dir)
            print(json.dumps(report, indent=2))
            return 1 if report["errors"] else 0
        if arguments.action == "verify":
            report = verify(arguments.profile, arguments.settings_dir)
            print(json.dumps(report, indent=2))
            return 1 if report["damaged"] else 0
        execute(arguments.action, arguments.profile, arguments.settings_dir)
        return 0
    except SettingsError as error:
        print(f"nnpd: settings error: {error}", file=sys.stderr)
        return 2
    except (LaunchError, DamagedArtifact) as error:
        print(f"nnpd: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nnpd: interrupted; everything committed so far is kept, and the same command resumes",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
