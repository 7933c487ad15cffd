"""nnpd: command line and orchestration of neural-ratio-estimation studies.

    python nnpd.py [plan|train|analyze|run|verify|report] [--profile NAME] [--settings-dir DIR]
    python nnpd.py infer RUN --observations FILE.npy [--samples N] [--plot]   (see infer.py)

`plan` (the default) only resolves and validates; `train` stops at committed weights; `analyze` analyses
the trained models and never trains; `run` does both per job; `verify` recomputes every checksum in the
profile's store and moves damage aside; `report` tabulates the analysed runs (with --csv FILE and --plot).
The same command works under `torchrun`, with workers taking disjoint jobs (`runtime.parallel="jobs"`) or
training each model together (`runtime.parallel="ddp"`).
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import infer
import jobs
import output_root
import probes
import results
import runtime
import settings
import study
import study_loading
import timings
from jobs import Job, Launch
from output_root import LaunchError
from settings import SettingsError
from store import ROOT_MARKER, NnpdError, Store, disk_problem, write_bytes_atomic

__all__ = ["load", "make_plan", "plan", "execute", "report", "main", "run_as_process"]
ACTIONS = ("plan", "train", "analyze", "run", "verify", "report", "infer")
CODE_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------- planning


def default_settings_dir():
    """The current directory when it holds settings files, else the code's directory."""
    here = Path.cwd()
    return here if (here / "settings_training.py").exists() else CODE_DIR


def load(profile=None, settings_dir=None):
    """The profile's settings, loaded and structurally validated, with the framework's sections checked."""
    loaded = settings.load_profile(Path(settings_dir) if settings_dir else default_settings_dir(), profile)
    settings.check_framework(loaded)
    settings.make_study_importable(loaded)  # for this launch: nnpd.main puts sys.path back after it
    return loaded


def configuration_jobs(configuration, analysis_settings):
    """Validate one configuration and list its jobs."""
    experiment, analysis = study_loading.load_study(configuration.settings, analysis_settings)
    members = experiment.members()
    for index, member in enumerate(members):
        settings.safe_name(member.get("name") if isinstance(member, dict) else None, f"cohort member {index}")
    if members:
        study_loading.check_logit_shape(experiment, members[0], configuration.settings["experiment"])
    return [Job(configuration, member, experiment, analysis, analysis.workload(member)) for member in members]


def workload_errors(job, limits):
    """Messages for every analysis limit this job's estimate exceeds."""
    checks = (
        ("model_evaluations", "max_model_evaluations"),
        ("saved_bytes", "max_saved_bytes"),
        ("candidate_points", "max_candidate_points"),
    )
    advice = study.optional(job.analysis, "WORKLOAD_ADVICE", study.Analysis)
    return [
        f"configuration {job.configuration.name} member {job.member['name']}: the analysis needs "
        f"{job.analysis_workload[need]:.3g} {need.replace('_', ' ')}, over verification.{limit}="
        f"{limits[limit]:.3g}; {advice} in settings_analysis.py, or raise the limit"
        for need, limit in checks
        if job.analysis_workload[need] > limits[limit]
    ]


@dataclass
class Plan:
    """Every job of a launch and what stands in its way."""

    jobs: list
    errors: list  # stop every stage
    analysis_errors: list  # stop analyze and run (workload over the limits)
    warnings: list


def make_plan(profile):
    """Validate every configuration and member before anything is computed."""
    found, errors, analysis_errors = [], [], []
    warnings_found: list[str] = []
    for configuration in profile.configurations:
        try:
            mine = configuration_jobs(configuration, profile.analysis)
        except SettingsError as error:
            errors.append(f"configuration {configuration.name}: {error}")
            continue
        found.extend(mine)
        for job in mine:
            analysis_errors.extend(workload_errors(job, profile.analysis["verification"]))
        for job in mine[:1]:  # a study's own lines, once per configuration
            stops, notes = study_loading.plan_notes(job.experiment, job.analysis)
            analysis_errors.extend(f"configuration {configuration.name}: {line}" for line in stops)
            warnings_found.extend(f"configuration {configuration.name}: {line}" for line in notes)
    folders = [job.run for job in found]
    repeated = sorted({run for run in folders if folders.count(run) > 1})
    if repeated:
        errors.append(f"cohort: two members share the run folder {repeated[0]}; cohort members must be distinct")
    try:
        warnings_found += runtime_warnings(profile) if not errors else []
    except SettingsError as error:
        errors.append(str(error))
    return Plan(found, errors, analysis_errors, warnings_found)


def runtime_warnings(profile):
    """Check the device and precisions for this process; warn about what will not do what it seems to."""
    runtime_settings = settings.check_runtime(profile.training["runtime"])
    _, world, local_rank = runtime.launch_environment()
    device = runtime.resolve_device(runtime_settings["device"], local_rank, world)
    for configuration in profile.configurations:
        runtime.check_precision(configuration.settings.get("training", {}).get("precision", "off"), device)
    found = []
    if runtime_settings["parallel"] == "ddp" and world == 1:
        found.append(
            'runtime.parallel="ddp" in a single process trains as one process; launch with '
            "torchrun --nproc_per_node=N for collective training"
        )
    if (profile.analysis.get("plots") or profile.analysis.get("cohort_plots")) and jobs.matplotlib_missing():
        found.append(
            "plots/cohort_plots: figures were requested but matplotlib is not installed, so they are "
            "skipped; install it with `pip install matplotlib` (the package's [plots] extra)"
        )
    return found


def plan_report(profile, plan):
    """The plan as a JSON-able dict."""
    configurations = []
    for configuration in profile.configurations:
        mine = [job for job in plan.jobs if job.configuration is configuration]
        configurations.append(
            {
                "name": configuration.name,
                "variant": configuration.variant,
                "knob": configuration.knob,
                "value": configuration.value,
                "input_size": mine[0].experiment.input_size() if mine else None,
                "jobs": [
                    {
                        "run": job.run,
                        "member": job.member["name"],
                        "workload": {**job.experiment.workload(job.member), **job.analysis_workload},
                    }
                    for job in mine
                ],
            }
        )
    return {
        "profile": profile.name,
        "settings_dir": str(profile.settings_dir),
        "output_root": profile.training["output"]["root"],
        "configurations": configurations,
        "jobs": len(plan.jobs),
        "warnings": plan.warnings,
        "errors": plan.errors + plan.analysis_errors,
    }


def plan(profile=None, settings_dir=None):
    """Resolve and validate every configuration and member; compute and write nothing."""
    loaded = load(profile, settings_dir)
    made = make_plan(loaded)
    made.errors.extend(output_root.root_errors(Path(loaded.training["output"]["root"])))
    return {**plan_report(loaded, made), "advice": plan_advice(loaded, made)}


def plan_advice(profile, made):
    """Which runtime.parallel suits the planned jobs: from the root's timings.json, else estimated."""
    costs = {job.run: jobs.job_cost(job) for job in made.jobs}
    return timings.plan_advice(profile.training["output"]["root"], costs, profile.training.get("runtime"))


# ---------------------------------------------------------------- the launch


def latest_training(profile):
    """For analyze: the profile with the training settings of the output root's latest training.

    When settings_training.py was edited after the last training, analysis still
    concerns the models that exist; the root keeps a byte copy of their settings.
    """
    root = Path(profile.training["output"]["root"])
    latest = output_root.latest_training_digest(root) if (root / ROOT_MARKER).is_file() else None
    if latest in (None, settings.identity(profile.training)) or not (root / profile.training_path.name).exists():
        return profile
    loaded = settings.load_profile(profile.settings_dir, profile.name, training_dir=root)
    settings.check_framework(loaded)
    if runtime.launch_environment()[0] == 0:
        output_root.warn(
            f"{profile.training_path} differs from the latest training; analysing the latest training "
            f"(settings in {loaded.training_path}); run train to train the edited settings"
        )
    return loaded


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
    output_root.refuse_wrong_root(root)
    rt = runtime.start(loaded.training["runtime"])
    runtime.STOP.install()
    try:
        launch = Launch(stage, loaded, root, Store(root), rt, runtime.backend_identity(rt))
        with open_launch(launch, [job.run for job in plan.jobs]):
            for warning in plan.warnings:
                launch.log(f"warning: {warning}")
            return run_launch(launch, plan.jobs)
    except OSError as error:
        if disk_problem(error, root) is None:
            raise
        raise LaunchError(disk_problem(error, root)) from None
    finally:
        runtime.STOP.uninstall()
        runtime.stop(rt)


@contextlib.contextmanager
def open_launch(launch, planned_runs=()):
    """Rank 0 claims, leases and tidies the root, making room for the planned run folders; then every worker joins."""
    if probes.PROBLEM:
        raise SettingsError(probes.PROBLEM)
    rt, minutes = launch.rt, launch.rt.timeout_minutes
    launch.store.phase = probes.phase  # the store's lookups and commits are timed too
    with contextlib.ExitStack() as held:
        snapshot = None
        if rt.is_main:
            with probes.phase("launch.open"):
                output_root.claim_root(launch.root, create=launch.stage != "analyze")
                output_root.refuse_unsafe_places(launch.root)  # before the lease, whose lock file is the first write
                held.enter_context(output_root.take_lease(launch.store, minutes))
                output_root.wait_for_leftovers(launch.store, minutes)
                output_root.tidy_root(launch.root, launch.store)
                output_root.clear_run_places(launch.root, launch.store, planned_runs, repair=launch.stage != "analyze")
                snapshot = output_root.write_snapshot(launch.root, CODE_DIR, launch.profile)
        launch.snapshot, launch.id = runtime.broadcast_object(rt, (snapshot, f"{time.time_ns():x}"))
        held.enter_context(output_root.join_launch(launch.store, minutes))
        if rt.distributed:
            launch.marks.mkdir(parents=True, exist_ok=True)
            jobs.keep_watch(launch)
        yield launch


def run_launch(launch, planned):
    """Run the stage over this worker's jobs, then finish the launch on rank 0 once all are done."""
    rt, root, profile = launch.rt, launch.root, launch.profile
    trained = {}
    if launch.stage == "analyze":  # check every model before anything is written
        trained = {job.run: jobs.trained_artifacts(launch, job) for job in planned}
    launch.log(
        f"{launch.stage} {profile.name}: {len(planned)} jobs, device {rt.device}, {rt.world_size} worker(s), "
        f"parallel={rt.parallel}, output {root}"
    )
    failures, timed = [], None
    for job in jobs.claim_jobs(launch, planned):
        with launch.timer.job(launch, job):
            failure = do_job(launch, job, trained.get(job.run))
        if failure:
            failures.append(failure)
            print(f"[nnpd rank {rt.rank}] {failure}", file=sys.stderr, flush=True)
    launch.wait_for_workers("jobs-done")
    gathered = runtime.all_gather_object(rt, (failures, sorted(launch.used), launch.timer.worker_record()))
    failures = [failure for part, _, _ in gathered for failure in part]
    if rt.is_main and not failures:
        with probes.phase("launch.finish"):
            finish_launch(launch, planned, trained, {key for _, used, _ in gathered for key in used})
        timed = launch.timer.report(launch, [record for _, _, record in gathered])
    launch.wait_for_workers("finished")
    runtime.barrier(rt)  # everyone is past the marks: rank 0 removes them
    if rt.is_main and rt.distributed:
        shutil.rmtree(launch.marks, ignore_errors=True)
    if failures:
        raise LaunchError(f"{len(failures)} job(s) failed; first: {failures[0]}")
    launch.log(f"{launch.stage} done: results in {root / 'runs'}")
    return {
        "stage": launch.stage,
        "profile": profile.name,
        "root": str(root),
        "runs": sorted(job.run for job in planned),
        "advice": timed and timed["advice"],
    }


def do_job(launch, job, trained=None):
    """Run one job's stage(s); returns an error message or None."""
    stage = "train"
    try:
        if launch.stage in ("train", "run"):
            data, model = jobs.train_job(launch, job)
        else:
            data, model = trained
        if launch.stage in ("analyze", "run"):
            stage = "analyze"
            if launch.owner:
                launch.log(f"analyze {job.run}", every_worker=True)
                jobs.analyze_job(launch, job, data, model)
            if launch.rt.ddp:
                launch.wait_for_workers("analysed")
        return None
    except (LaunchError, KeyboardInterrupt):
        raise
    except Exception as error:
        if runtime.STOP.requested is not None:  # the study's code swallowed a stop, then failed for want of it
            raise
        run_dir = launch.root / job.run
        output_root.fail_job(run_dir, stage, error)
        where = run_dir / ("status.json" if stage == "train" else "analysis.json")
        message = f"{job.run}: {stage} failed on worker {launch.rt.rank}: {error} (traceback in {where})"
        if launch.rt.ddp:  # the other ranks cannot go on without this one: end the whole launch
            raise LaunchError(message) from error
        return message


def finish_launch(launch, planned, trained, used):
    """Rank 0 after every job succeeded: cohort figures, history, clean-up, settings copies."""
    root, profile = launch.root, launch.profile
    if launch.stage != "train":
        jobs.cohort_figures(launch, planned, trained)
    fields = {
        "digest": settings.identity(profile.training),
        "profile": profile.name,
        "runs": sorted(job.run for job in planned),
        "source": launch.snapshot,
        "settings": settings.to_jsonable(profile.training),
    }
    files = {job.configuration.name: job.files for job in planned if job.files}
    if files:  # a bank's content: the same settings on another bank are another training
        fields["files"] = files
    backend = {"digest": settings.digest(launch.identity), "identity": launch.identity}
    # A training launch keeps the analyses still valid for its models, so it keeps what they refer to.
    used = used | output_root.referenced_keys(root, fields["runs"])
    entries = output_root.record_launch(root, fields, backend, used, replace=launch.stage != "analyze")
    if launch.stage != "analyze":
        output_root.clean_up(root, launch.store, set(fields["runs"]), entries)
    output_root.copy_settings(root, profile)
    if launch.stage != "train":
        records = results.read_runs(root, fields["runs"])
        print(
            results.report_text(
                records,
                study_loading.report_layout(profile.analysis)[0],
                study_loading.report_warnings(profile.analysis),
            ),
            flush=True,
        )


def verify(profile=None, settings_dir=None):
    """Recompute every checksum in the profile's store, move damaged entries aside and report."""
    loaded = load(profile, settings_dir)
    root = Path(loaded.training["output"]["root"])
    # A folder nnpd does not own is refused before anything is written there (locks/, damaged/).
    if not output_root.owns_root(root) or not (root / "cache").is_dir():
        raise LaunchError(f"{root}: no store to verify; run `python nnpd.py train --profile {loaded.name}` first")
    output_root.refuse_unsafe_places(root)
    store = Store(root)
    with output_root.take_lease(store, settings.check_runtime(loaded.training["runtime"])["timeout_minutes"]):
        checked, damaged = store.verify(repair=True)
        damaged += output_root.verify_records(root, store)
        entries, size = store.damaged_size()
    return {
        "root": str(root),
        "checked": checked,
        "damaged": damaged,
        "damaged_folder": {"entries": entries, "bytes": size},
    }


def report(profile=None, settings_dir=None, csv_path=None, plot=False):
    """The table of every analysed run of the profile's root; optionally its CSV and comparison figure."""
    loaded = load(profile, settings_dir)
    root = Path(loaded.training["output"]["root"])
    records = results.read_runs(root)
    if not any(record.metrics is not None for record in records):
        raise LaunchError(f"{root}: no analysed runs yet; run `python nnpd.py run --profile {loaded.name}` first")
    notes, (columns, panels) = [], study_loading.report_layout(loaded.analysis)
    if csv_path:
        notes.append(f"{results.write_csv(records, csv_path)} rows written to {csv_path}")
    if plot and jobs.matplotlib_missing():
        notes.append("--plot: skipped, matplotlib is not installed (pip install matplotlib)")
    elif plot:
        png = results.comparison_png(records, panels, f"Analysed runs of profile {loaded.name} ({root})")
        if png is not None:
            write_bytes_atomic(root / "report" / "comparison.png", png)
        notes.append(
            f"figure written to {root / 'report' / 'comparison.png'}"
            if png is not None
            else "--plot: nothing to draw (no analysed run has a metric of the figure); no figure written"
        )
    return results.report_text(records, columns, study_loading.report_warnings(loaded.analysis)), notes


# ---------------------------------------------------------------- command line


def parse_arguments(argv):
    """The command line: an action, a profile and a settings directory."""
    parser = argparse.ArgumentParser(prog="nnpd", description=__doc__.split("\n")[0])
    parser.add_argument("action", nargs="?", default="plan", choices=ACTIONS)
    parser.add_argument("--profile", help="profile name (default: DEFAULT_PROFILE, or a SETTINGS file's own)")
    parser.add_argument("--settings-dir", help="directory holding settings_training.py and settings_analysis.py")
    parser.add_argument("--csv", metavar="FILE", help="report: also write one CSV row per analysed run")
    parser.add_argument("--plot", action="store_true", help="report: also draw the comparison figure")
    infer.add_arguments(parser)
    return parser.parse_args(argv)


def one_line(error):
    """An error's message on one line."""
    return " ".join(str(error).split())


def format_warning(message, category, filename, lineno, line=None):
    """nnpd's warnings as `nnpd: warning:`, a study's or a library's as `file:line: warning:` (not nnpd's)."""
    own = Path(filename).resolve().parent == Path(__file__).resolve().parent
    return f"{'nnpd' if own else f'{Path(filename).name}:{lineno}'}: warning: {one_line(message)}\n"


def run_action(arguments):
    """Carry out one action; returns the exit status."""
    if arguments.action == "plan":
        planned = plan(arguments.profile, arguments.settings_dir)
        print(json.dumps(planned, indent=2))
        if planned["errors"]:
            print(f"nnpd: settings error: {one_line(planned['errors'][0])}", file=sys.stderr)
        return 2 if planned["errors"] else 0
    if arguments.action == "report":
        text, notes = report(arguments.profile, arguments.settings_dir, arguments.csv, arguments.plot)
        print("\n".join([text, *notes]))
        return 0
    if arguments.action == "infer":
        return infer.command(arguments)
    if arguments.action == "verify":
        checked = verify(arguments.profile, arguments.settings_dir)
        print(json.dumps(checked, indent=2))
        return 1 if checked["damaged"] else 0
    execute(arguments.action, arguments.profile, arguments.settings_dir)
    return 0


def ended_by(error):
    """The exit status of a launch that `error` ended, after its one line on stderr; None for a bug's traceback."""
    stopped = runtime.reported_stop(error)  # a stop first: an NnpdError too, and it explains what failed after it
    problem = (
        one_line(error) if isinstance(error, NnpdError) else disk_problem(error) if isinstance(error, OSError) else None
    )
    if stopped is None and problem is not None:  # a launch's, the store's, restore's, a full disk: the user's to fix
        print(f"nnpd: {'settings error' if isinstance(error, SettingsError) else 'error'}: {problem}", file=sys.stderr)
        return 2 if isinstance(error, SettingsError) else 1
    return stopped


def main(argv=None):
    """Run the command line; returns the exit status."""
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    if probes.PROBLEM:
        print(f"nnpd: settings error: {probes.PROBLEM}", file=sys.stderr)
        return 2
    # Until the end is printed (see runtime.StopRequest); then what the launch changed is put back.
    with runtime.STOP.handling(), runtime.process_settings_kept():
        warnings.formatwarning = format_warning
        try:
            status = run_action(arguments)
            sys.stdout.flush()  # here, not at exit, so that a reader who left is noticed below
            return status
        except BrokenPipeError:  # `nnpd plan | head`: the reader left; before OSError, of which it is one
            # What is still buffered goes nowhere, so the flush at exit cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except (KeyboardInterrupt, Exception) as error:
            status = ended_by(error)
            if status is None:
                raise
            return status


def run_as_process() -> NoReturn:
    """Run the command line as this process's whole life, then exit with its status."""
    # The stop handlers stay installed to the end: main's own pair puts the default handler
    # back when it ends, and a repeated SIGTERM (Slurm, torchrun) landing between that and
    # exit_status would kill the process after it printed that its state was saved.
    runtime.STOP.install()
    sys.exit(runtime.exit_status(main()))


if __name__ == "__main__":
    run_as_process()
