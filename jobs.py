"""One launch's jobs: what a worker does for each trained model, and how workers meet.

A job is one configuration times one cohort member. `train_job` gets or samples the data and
gets or trains the model through the store; `analyze_job` computes the selected metrics,
building analysis products lazily. Workers of a launch meet at marker files on the output
root rather than in timed collectives, because one may wait long for another.
"""

import io
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

import fingerprint
import output_root
import probes
import runtime
import study
import study_loading
import timings
import trainer
from output_root import LaunchError
from settings import Configuration, Profile, digest
from store import DamagedArtifact, Store, now_iso, write_bytes_atomic, write_json_atomic
from training_hooks import TrainingHooks

__all__ = [
    "Job",
    "Launch",
    "RoundTools",
    "keep_watch",
    "model_recipe",
    "train_job",
    "trained_artifacts",
    "analyze_job",
    "matplotlib_missing",
    "draw_figures",
    "cohort_figures",
    "job_cost",
    "claim_jobs",
]


@dataclass
class Job:
    """One trained model: a configuration times a cohort member."""

    configuration: Configuration
    member: dict
    experiment: study.ExperimentContract
    analysis: study.AnalysisContract
    analysis_workload: dict
    run: str = field(init=False)  # the run folder relative to the output root
    files: dict = field(init=False)  # the experiment's file_digests(): the content of files its settings name

    def __post_init__(self) -> None:
        """Name the run folder after the cohort member: a study trained in rounds keeps it for every round.

        The content of files the settings name (a bank) enters the name too, so an overwritten bank
        is another run; without such files the name is the settings' and the member's alone.
        """
        self.files = study.optional(self.experiment, "file_digests", study.Experiment)()
        named = {"configuration": self.configuration.digest, "member": self.member}
        tag = digest({**named, "files": self.files} if self.files else named)[:10]
        self.run = f"runs/{self.configuration.name}/{self.member['name']}-{tag}"

    @property
    def settings(self):
        """The configuration's resolved training settings."""
        return self.configuration.settings


@dataclass
class Launch:
    """What every job of one launch shares: where it writes, how it runs, who it is."""

    stage: str
    profile: Profile
    root: Path
    store: Store
    rt: runtime.Runtime
    identity: dict
    snapshot: str = ""
    id: str = ""
    waits: int = 0
    used: set = field(default_factory=set)  # keys of every artifact this worker's jobs used
    timer: timings.LaunchTimer = field(init=False)  # this worker's timings of the launch

    def __post_init__(self) -> None:
        """Start this worker's timings of the launch."""
        self.timer = timings.LaunchTimer(self.rt)

    @property
    def owner(self):
        """Whether this worker writes the folders of the jobs it runs (the one that leads their training)."""
        return self.rt.leads_training

    def log(self, message, every_worker=False):
        """Progress: launch-wide lines from rank 0; job lines from every worker in jobs mode, with its rank."""
        if self.rt.is_main or (every_worker and not self.rt.ddp):
            who = f" rank {self.rt.rank}" if self.rt.distributed and every_worker and not self.rt.ddp else ""
            print(f"[nnpd {time.strftime('%H:%M:%S')}{who}] {message}", flush=True)

    @property
    def marks(self):
        """The folder where workers mark the points they reached."""
        return self.root / "locks" / f"launch-{self.id}"

    def wait_for_workers(self, step):
        """Wait until every worker has reached `step`.

        Where one worker may wait long (others still training, rank 0 analysing), a
        collective would hit the process-group timeout; marker files have none. A worker
        whose heartbeat stopped for runtime.timeout_minutes is taken for dead.
        """
        if not self.rt.distributed:
            return
        self.waits += 1
        name = f"{self.waits}-{step}"
        (self.marks / f"{name}-{self.rt.rank}").touch()
        with probes.phase("launch.wait"):
            self.wait_for_marks(name, step)

    def wait_for_marks(self, name, step):
        """Wait until every worker has touched the mark `name`, or one stopped answering."""
        while True:
            missing = [rank for rank in range(self.rt.world_size) if not (self.marks / f"{name}-{rank}").exists()]
            if not missing:
                return
            silent = [rank for rank in missing if self.silent_for(rank) > 60 * self.rt.timeout_minutes]
            if silent:
                raise LaunchError(
                    f"worker(s) {silent} stopped answering (no heartbeat for "
                    f"{self.rt.timeout_minutes:g} minutes, runtime.timeout_minutes) before {step!r}; "
                    "the launch ends; the same command resumes"
                )
            time.sleep(0.2)

    def silent_for(self, rank):
        """Seconds since worker `rank` last beat its heartbeat."""
        try:
            return time.time() - (self.marks / f"alive-{rank}").stat().st_mtime
        except FileNotFoundError:
            return 0.0


def keep_watch(launch, interval=2.0, grace=10.0):
    """Start this worker's watch: beat a heartbeat file, and stop the worker when its launcher dies.

    torchrun starts each worker in a session of its own, so a killed agent leaves workers
    running; a worker whose parent changed asks itself to stop (SIGTERM: training saves its
    state), then exits hard after `grace` seconds.
    """
    parent = os.getppid()
    heartbeat = launch.marks / f"alive-{launch.rt.rank}"

    def watch():
        orphaned_at = None
        while True:
            try:
                heartbeat.touch()
            except FileNotFoundError:
                return  # rank 0 removed the launch's marks: the launch is over
            if orphaned_at is None and os.getppid() != parent:
                orphaned_at = time.monotonic()
                print(f"[nnpd rank {launch.rt.rank}] the launcher died; stopping", file=sys.stderr, flush=True)
                runtime.request_stop()
            if orphaned_at is not None and time.monotonic() - orphaned_at > grace:
                os._exit(1)
            time.sleep(interval)

    threading.Thread(target=watch, name="nnpd-watch", daemon=True).start()


# ---------------------------------------------------------------- recipes

DATA_SPLITS = ("train", "validation", "test")  # the order of a data artifact's per-split counts


def data_recipe(job):
    """The training data's recipe: no backend identity, so CPU and CUDA share data."""
    return {
        "experiment": job.experiment.data_recipe(job.member),
        "source": fingerprint.source_fingerprint(*study_loading.experiment_sources(job.experiment, "DATA_SOURCES")),
        "versions": fingerprint.library_versions(),
    }


def model_recipe(job, data_key, identity):
    """The model's recipe: settings, data, source, versions and backend identity."""
    return {
        "experiment": job.experiment.model_recipe(job.member),
        "data": data_key,
        "backend": identity,
        "source": fingerprint.source_fingerprint(*study_loading.experiment_sources(job.experiment, "MODEL_SOURCES")),
        "versions": fingerprint.library_versions(),
    }


def launch_log(launch):
    """A progress line's way into the launch's log: every worker's own, with its rank."""
    return lambda line: launch.log(line, every_worker=True)


def write_data(launch, job, writer):
    """Build the training-data artifact, showing the progress the study reports (study.report_progress)."""
    progress = study.Progress(launch_log(launch), f"data    {job.run}", unit="simulations")
    with probes.phase("data.sample"), study.progress_to(progress):
        arrays = job.experiment.sample_data(job.member)
    for name, array in arrays.items():
        writer.array(name, array)
    metadata = {
        "rows": {name: int(array.shape[0]) for name, array in arrays.items() if name.endswith(("_labels", "_x"))}
    }
    if "dropped_simulations" in arrays:  # the kit's invalid simulations dropped, per split (docs/training.md)
        metadata["dropped_simulations"] = dict(zip(DATA_SPLITS, map(int, arrays["dropped_simulations"])))
    return metadata


def write_model(writer, state, history):
    """Build the model artifact: weights plus the training history."""
    writer.weights(state)
    writer.json("history", history)
    return {"selected_epoch": history.get("selected_epoch"), "epochs": history.get("epochs")}


# ---------------------------------------------------------------- training


class RoundTools(NamedTuple):
    """What a study trained in rounds gets to make its next round's member (the study's `next_round`)."""

    trained: Callable[[], Any]  # the current round's (data, model), got or trained through the store
    store: Store
    rt: runtime.Runtime
    log: Callable[[str], None]
    used: set  # keys the launch used: what a round caches is kept with them


def train_job(launch, job):
    """Get or sample the data, then get or train the model; status becomes `trained` (timed as a stage).

    A study with `next_round(member, tools)` trains in rounds: each round's member is trained
    in turn through the store alone, and the run records the last (docs/rounds.md).
    """
    with launch.timer.stage("training"):
        next_round = getattr(job.experiment, "next_round", None)
        while next_round is not None:
            tools = RoundTools(
                lambda: get_artifacts(launch, job), launch.store, launch.rt, launch_log(launch), launch.used
            )
            member = next_round(job.member, tools)
            if member is None:
                break
            job.member = member  # the same run folder (Job.run), the next round's member
        return get_trained(launch, job)


def get_trained(launch, job):
    """The job's data and model, reused or made now."""
    store, rt, run_dir = launch.store, launch.rt, launch.root / job.run
    recipe_of_data = data_recipe(job)
    data_key = store.key("training-data", recipe_of_data)
    recipe = model_recipe(job, data_key, launch.identity)
    current = launch.owner and output_root.trained_keys(run_dir) == (data_key, store.key("model", recipe))
    if launch.owner and not current:
        launch.timer.did_work("training")
        output_root.start_run(launch.root, job.run, run_record(launch, job), rt.rank)
    data, model = get_artifacts(launch, job)
    if launch.owner and not current:
        dropped = (data.metadata or {}).get("dropped_simulations")
        if dropped:  # run.json says what the model was trained without; the report repeats it
            output_root.add_to_record(run_dir / "run.json", dropped_simulations=dropped)
        output_root.write_artifacts(launch.root, run_dir, {"training-data": data, "model": model})
        output_root.write_status(
            run_dir,
            "trained",
            worker=rt.rank,
            data=data.key,
            model=model.key,
            selected_epoch=model.metadata.get("selected_epoch"),
        )
    return data, model


def get_artifacts(launch, job):
    """The job's data and model through the store alone, reused or made now (no run folder is written)."""
    store, recipe_of_data = launch.store, data_recipe(job)
    data_key = store.key("training-data", recipe_of_data)
    data = find_intact(store, "training-data", data_key)
    if data is None:
        launch.log(f"data    {job.run}: sampling", every_worker=True)
        build = runtime.unless_stopped(lambda writer: write_data(launch, job, writer))
        data = store.get("training-data", recipe_of_data, build=build)
    else:
        launch.log(f"data    {job.run}: reused", every_worker=True)
    model = get_model(launch, job, data, model_recipe(job, data_key, launch.identity))
    launch.used |= {artifact.key for artifact in (data, model) if artifact is not None}
    return data, model


def run_record(launch, job):
    """What run.json says of a job: settings, member, backend, versions, source."""
    return {
        "configuration": job.configuration.name,
        "variant": job.configuration.variant,
        "knob": job.configuration.knob,
        "value": job.configuration.value,
        "member": job.member,
        "settings": job.settings,
        "backend": launch.identity,
        "versions": fingerprint.library_versions(),
        "source": launch.snapshot,
        "description": job.experiment.describe(job.member),
        "study_path": study_loading.module_folder(type(job.experiment)),
    }


def get_model(launch, job, data, recipe):
    """The committed model, trained now (resuming a saved state) when the store lacks it."""
    store, rt = launch.store, launch.rt
    key = store.key("model", recipe)
    found = find_intact(store, "model", key) if launch.owner else None
    # In ddp every rank must train together, so rank 0 decides for all of them.
    reused = runtime.broadcast_object(rt, found is not None) if rt.ddp else found is not None
    if reused:
        launch.log(f"model   {job.run}: reused", every_worker=True)
        return found
    launch.log(f"train   {job.run}", every_worker=True)
    started = time.monotonic()
    if not rt.ddp:
        build = runtime.unless_stopped(lambda writer: write_model(writer, *train_model(launch, job, data, key)))
        model = store.get("model", recipe, build=build)
    else:
        # Training cannot happen under the artifact's lock here: rank 0 commits what all trained.
        state, history = train_model(launch, job, data, key)
        build = runtime.unless_stopped(lambda writer: write_model(writer, state, history))
        model = store.get("model", recipe, build=build) if rt.is_main else None
        runtime.barrier(rt)
    if launch.owner:
        store.drop_scratch("model", key)
    launch.log(f"model   {job.run}: trained in {time.monotonic() - started:.1f} s", every_worker=True)
    return model


def train_model(launch, job, data, key):
    """Train one model with hooks that save and resume its state in the store's scratch area."""
    model = job.experiment.build_model(job.member)
    with runtime.STOP.polling():
        state, history = job.experiment.train(job.member, model, data, launch.rt, training_hooks(launch, job, key))
    outcome = trainer.training_outcome(history)
    if outcome is not None:  # the bundled trainer's history: how it ended and what it kept
        launch.log(f"model   {job.run}: {outcome}", every_worker=True)
    return state, history


def training_hooks(launch, job, key):
    """Hooks that keep the model's whole training state under scratch/, report epochs and stop on SIGTERM."""
    store = launch.store

    def load_state():
        # A damaged state raises here; the trainer warns and starts afresh (its next save replaces it).
        payload = store.load_scratch("model", key)
        return None if payload is None else torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)

    def save_state(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        store.save_scratch("model", key, buffer.getvalue())

    def on_epoch(epoch, record):
        launch.log(f"        epoch {epoch}/{record['epochs']}: {epoch_text(record)}", every_worker=True)

    def on_resume(epoch, batch):
        launch.log(f"resumed {job.run}: epoch {epoch}, after batch {batch}", every_worker=True)

    return TrainingHooks(
        load_state=load_state,
        save_state=save_state,
        save_seconds=launch.rt.resume_seconds,
        stop_requested=runtime.STOP,
        on_epoch=on_epoch,
        on_resume=on_resume,
    )


def epoch_text(record):
    """An epoch's log line: the training loss, the trained objective's validation loss, then BCE and AUC."""
    auc = "n/a" if record["auc"] is None else f"{record['auc']:.3f}"
    name = record.get("objective_name", "BCE")
    objective = "validation " if name == "BCE" else f"validation {name} {record['objective']:.4f}, "
    return f"loss {record['train_loss']:.4f}, {objective}BCE {record['bce']:.4f}, AUC {auc}, {record['seconds']:.1f} s"


def find_intact(store, name, key):
    """A committed, undamaged artifact, or None (a damaged one is rebuilt by `get`)."""
    try:
        return store.find(name, key)
    except DamagedArtifact:
        return None


def trained_artifacts(launch, job):
    """The committed data and weights a run's status records, or an error saying to train."""
    store, run_dir = launch.store, launch.root / job.run
    fix = f"run `python nnpd.py train --profile {launch.profile.name}` first"
    keys = output_root.trained_keys(run_dir)
    if keys is None:
        status = output_root.read_json(run_dir / "status.json", {})
        used = output_root.read_json(run_dir / "artifacts.json", {})
        if status.get("state") == "trained" and Path(str(used.get("model"))).name != status.get("model"):
            raise LaunchError(
                f"{run_dir}: its status says trained, but artifacts.json (which names the data and "
                f"model the run used) is missing or names others; {fix}: it records them again "
                "from the store, retraining nothing the store still holds"
            )
        state = f"state {status['state']}" if status.get("state") else "no run folder"
        raise LaunchError(f"{run_dir}: no trained model ({state}); {fix}")
    record = output_root.read_json(run_dir / "run.json", {})
    backend, member = record.get("backend"), record.get("member")
    if isinstance(member, dict) and all(member.get(key) == value for key, value in job.member.items()):
        job.member = member  # the member it was trained as: a later round's, which extends the planned one
    if backend != launch.identity:
        raise LaunchError(
            f"{run_dir}: its model was trained on another backend ({describe_backend(backend)}), "
            f"not this one ({describe_backend(launch.identity)}); {fix} here, or restore it with "
            "store.restore(run_dir, device=...)"
        )
    try:
        data, model = store.find("training-data", keys[0]), store.find("model", keys[1])
    except DamagedArtifact as error:
        raise LaunchError(f"{error}; {fix} to rebuild it") from None
    if data is None or model is None:
        raise LaunchError(f"{run_dir}: its trained model or data is missing from the store; {fix}")
    return data, model


def describe_backend(identity):
    """A short description of a backend identity."""
    if not isinstance(identity, dict):
        return "unknown"
    return f"{identity.get('device_type')}, DDP world size {identity.get('ddp_world_size')}"


# ---------------------------------------------------------------- analysis


def analyze_job(launch, job, data, model):
    """Compute the selected metrics of one trained model, building products lazily (timed as a stage)."""
    with launch.timer.stage("analysis"):
        return analyze_model(launch, job, data, model)


def analyze_model(launch, job, data, model):
    """The metrics of one trained model, reused when its model, code and settings are unchanged."""
    run_dir = launch.root / job.run
    settings = job.analysis.settings
    done = output_root.read_json(run_dir / "analysis.json", {})
    if done.get("state") == "complete":
        problem = output_root.analysis_problem(launch.store, run_dir)
        same = (done.get("model"), done.get("source"), done.get("settings")) == (model.key, launch.snapshot, settings)
        if problem is None and same:
            launch.used |= set(done["artifacts"])
            return output_root.read_json(run_dir / "metrics.json", {})  # same model, code and settings, all intact
        if problem is not None:
            output_root.warn(f"{run_dir}: its analysis cannot be reused ({problem}); analysing it again")
    launch.timer.did_work("analysis")
    output_root.clear_analysis(run_dir)
    record = {"settings": settings, "source": launch.snapshot, "model": model.key, "worker": launch.rt.rank}
    output_root.write_record(run_dir / "analysis.json", {"state": "running", **record, "time": now_iso()})
    ctx = study.Context(
        job.settings,
        settings,
        job.member,
        job.experiment,
        job.analysis,
        launch.rt,
        run_dir,
        launch.store,
        data,
        model,
        progress=study.Progress(launch_log(launch), f"analyze {job.run}"),
    )
    values = {}
    for name in settings["metrics"]:
        with probes.phase(f"metric.{name}"):
            values[name] = study_loading.metric_value(name, job.analysis.metrics[name].compute(ctx))
        write_json_atomic(run_dir / "metrics" / f"{name}.json", values[name])
    write_json_atomic(run_dir / "metrics.json", values)
    draw_figures(job.analysis.plots, settings["plots"], ctx, run_dir / "plots", settings["plotting"])
    used = {"training-data": data, "model": model, **ctx.used}
    output_root.write_artifacts(launch.root, run_dir, used)
    keys = sorted(artifact.key for artifact in used.values())
    output_root.write_record(
        run_dir / "analysis.json",
        {"state": "complete", **record, "artifacts": keys, "metrics": digest(values), "time": now_iso()},
    )
    launch.used |= set(keys)
    return values


# ---------------------------------------------------------------- figures


def matplotlib_missing():
    """Whether figures cannot be drawn here (matplotlib is an optional extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def draw_figures(figures, selected, target, folder, plotting):
    """Draw the selected figures into folder, each written atomically; skipped without matplotlib."""
    if not selected or matplotlib_missing():
        return
    from matplotlib.figure import Figure  # no pyplot: no global state, nothing left open

    fmt, dpi = plotting.get("format", "png"), plotting.get("dpi", 120)
    for name in selected:
        with probes.phase(f"figure.{name}"):
            figure = Figure(figsize=(12, 7), layout="constrained")
            figures[name].draw(target, figure)
            buffer = io.BytesIO()
            figure.savefig(buffer, format=fmt, dpi=dpi)
            write_bytes_atomic(folder / f"{name}.{fmt}", buffer.getvalue())


def cohort_figures(launch, jobs, trained):
    """Per configuration, the cohort figures across its members (rank 0, after every job)."""
    for configuration in launch.profile.configurations:
        members = [job for job in jobs if job.configuration is configuration]
        # The analysis class's settings: it may fill the figures the settings file leaves out.
        settings = members[0].analysis.settings if members else {}
        if not settings.get("cohort_plots"):
            continue
        # Each job's analysis settings, with its study's defaults filled in: the products' keys read them.
        contexts = [
            study.Context(
                job.settings,
                job.analysis.settings,
                job.member,
                job.experiment,
                job.analysis,
                launch.rt,
                launch.root / job.run,
                launch.store,
                *(trained.get(job.run) or trained_artifacts(launch, job)),
            )
            for job in members
        ]
        folder = launch.root / "runs" / configuration.name / "plots"
        if folder.exists():
            output_root.discard(folder)  # figures no longer selected do not linger
        launch.log(f"figures {configuration.name}")
        draw_figures(
            members[0].analysis.cohort_plots,
            settings["cohort_plots"],
            contexts,
            folder,
            launch.profile.analysis["plotting"],
        )


# ---------------------------------------------------------------- claiming


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
        yield from jobs[rt.rank :: rt.world_size]
        return
    order = sorted(range(len(jobs)), key=lambda i: -job_cost(jobs[i]))
    claims = launch.marks / "claims.json"
    while True:
        with launch.store.lock(f"claims-{launch.id}"):
            taken = output_root.read_json(claims, [])
            free = [i for i in order if i not in taken]
            if not free:
                return
            write_json_atomic(claims, taken + [free[0]])
        yield jobs[free[0]]
