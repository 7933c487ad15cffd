"""Timings of a launch: the probes' phases per run and per worker, the launch's table, and advice.

Every worker keeps a LaunchTimer. Each job's stages (training, analysis) run in windows
that fold what the probes recorded meanwhile into a section of the run, and the run's
`timings.json` gets those sections (in DDP, every worker's part). A section is replaced
only when its stage did its work in this launch (sampled or trained; computed the
metrics), or when the file lacks it: a launch that reuses everything keeps the timings
of the launches that did the work, and a train-only launch's training section survives
a later analysis (output_root.clear_analysis removes the file; the job writes it back whole).
A retrained model drops the old analysis section with its analysis.

At the end rank 0 gathers every worker's phases into `<root>/timings.json`, prints a
short table (phase, total, share of the workers' summed wall time, count) and one line
of advice: which `runtime.parallel` the next launch should use, from the share of each
training step spent in DDP's gradient communication, the number of jobs against the
workers, and the spread of job sizes. `plan` gives the same advice from that file, or
estimates it from the workload when there is none.

Phases may nest: DDP's communication lies within the backward pass, a product built
lazily within the metric that first needs it, a store commit within its product.
"""

import contextlib
import time
from pathlib import Path

import output_root
import probes
import runtime
from probes import COMMUNICATE, STEP_PHASES
from store import now_iso, write_json_atomic

__all__ = [
    "add_phases",
    "LaunchTimer",
    "run_sections",
    "job_record",
    "communication_share",
    "busy_share",
    "advise",
    "plan_advice",
]

FILE = "timings.json"
STAGES = ("training", "analysis")
TABLE_ROWS = 12
BUSY_ENOUGH = 0.8  # jobs mode is kept while it keeps the workers at least this busy


# ---------------------------------------------------------------- phases


def add_phases(total, phases):
    """Add one snapshot's phases to a running total (counts and times add, extremes combine); returns it."""
    for name, record in phases.items():
        mine = total.setdefault(name, {})
        for key, value in record.items():
            if key in ("min_s", "max_s"):
                present = [v for v in (mine.get(key), value) if v is not None]
                mine[key] = (min if key == "min_s" else max)(present) if present else None
            else:
                mine[key] = mine.get(key, 0) + value
    return total


def phase_seconds(phases, name, clock):
    """A phase's total on a clock ("device" or "host"); 0 when absent."""
    record = phases.get(name, {})
    return record.get("device_s", 0.0) if clock == "device" else record.get("total_s", 0.0)


def step_summary(phases, device_type):
    """Seconds in training steps and in DDP's gradient communication, on the clock that measures them."""
    clock = "device" if any("device_s" in phases.get(name, {}) for name in STEP_PHASES) else "host"
    return {
        "step_s": sum(phase_seconds(phases, name, clock) for name in STEP_PHASES),
        "communicate_s": phase_seconds(phases, COMMUNICATE, clock),
        "clock": clock,
        "device_type": device_type,
    }


def add_steps(total, summary):
    """Add one run's step summary to a running total."""
    if total is None:
        return dict(summary)
    return {
        **total,
        "step_s": total["step_s"] + summary["step_s"],
        "communicate_s": total["communicate_s"] + summary["communicate_s"],
        "clock": summary["clock"] if summary["clock"] == total["clock"] else "host",
    }


# ---------------------------------------------------------------- one worker's timer


class LaunchTimer:
    """One worker's timings of one launch: its phases, and the sections of the job it is doing."""

    def __init__(self, rt):
        self.rt = rt
        self.began = time.perf_counter()
        self.phases = {}  # everything this worker's probes recorded in this launch
        self.sections = {}  # stage -> {"wall_s", "phases"} of the job in progress
        self.redone = set()  # stages of the job in progress that did their work
        self.jobs = {}  # run -> {"size_s", "steps"} of the jobs this worker finished
        probes.reset()

    def collect(self):
        """Fold what the probes hold into the launch's phases and start them afresh; returns it."""
        snapshot = probes.snapshot()
        probes.reset()
        add_phases(self.phases, snapshot)
        return snapshot

    @contextlib.contextmanager
    def stage(self, stage):
        """Time one stage of the job in progress as a section (kept only when the stage succeeds)."""
        self.collect()
        began = time.perf_counter()
        yield
        self.sections[stage] = {"wall_s": time.perf_counter() - began, "phases": self.collect()}

    def did_work(self, stage):
        """Note that this stage of the job in progress does its work in this launch (not a reuse)."""
        self.redone.add(stage)

    @contextlib.contextmanager
    def job(self, launch, job):
        """Around one job: afterwards (in DDP with every worker's part) write its run's timings.json."""
        run_dir = launch.root / job.run
        old = output_root.read_json(run_dir / FILE, {}) if launch.owner else {}
        self.sections, self.redone = {}, set()
        yield
        self.collect()
        parts = (
            runtime.all_gather_object(self.rt, (self.sections, self.redone))
            if self.rt.ddp
            else [(self.sections, self.redone)]
        )
        ranks = range(len(parts)) if self.rt.ddp else [self.rt.rank]
        sections = run_sections(old, dict(zip(ranks, parts)), self.info(launch))
        # A reusing launch rewrites nothing (unless the file went, with an analysis that failed).
        if launch.owner and sections and (sections != old or not (run_dir / FILE).exists()):
            write_json_atomic(run_dir / FILE, sections)
        if launch.owner:
            self.jobs[job.run] = job_record(sections, self.rt.device.type)

    def info(self, launch):
        """What every timings record says about the launch that made it."""
        rt = self.rt
        return {
            "launch": launch.id,
            "stage": launch.stage,
            "time": now_iso(),
            "probes": probes.MODE,
            "cuda_events": probes.DEVICE_TIMER is not None,
            "device": str(rt.device),
            "parallel": rt.parallel,
            "world_size": rt.world_size,
        }

    def worker_record(self):
        """This worker's whole launch so far: wall time, phases and finished jobs (what rank 0 gathers)."""
        self.collect()
        return {
            "rank": self.rt.rank,
            "wall_s": time.perf_counter() - self.began,
            "phases": self.phases,
            "jobs": self.jobs,
        }

    def report(self, launch, gathered):
        """Rank 0 at the end: write <root>/timings.json, print the table and the advice; returns the record."""
        workers = [self.worker_record() if part["rank"] == self.rt.rank else part for part in gathered]
        record = launch_record(self.info(launch), launch.profile.name, workers, self.rt.device.type)
        write_json_atomic(launch.root / FILE, record)
        print("\n".join(table_lines(record, launch.root / FILE) + [f"advice: {record['advice']}"]), flush=True)
        return record


def run_sections(old, parts, info):
    """A run's timings.json: old sections kept unless their stage was redone (or made stale), new ones added."""
    sections = {}
    retrained = any("training" in redone for _, redone in parts.values())
    for stage in STAGES:
        workers = {str(rank): part[stage] for rank, (part, _) in parts.items() if stage in part}
        new = {**info, "workers": workers} if workers else None
        stale = any(stage in redone for _, redone in parts.values()) or (stage == "analysis" and retrained)
        chosen = new if stale or not sound_section(old.get(stage)) else old[stage]
        if chosen is not None:
            sections[stage] = chosen
    return sections


def sound_section(section):
    """Whether a section read back from a run's timings.json has the shape this module writes."""
    workers = section.get("workers") if isinstance(section, dict) else None
    return isinstance(workers, dict) and all(
        isinstance(part, dict) and isinstance(part.get("wall_s"), (int, float)) and sound_phases(part.get("phases"))
        for part in workers.values()
    )


def sound_phases(phases):
    """Whether phases read back map names to records of numbers, as probes.snapshot() makes them."""
    return isinstance(phases, dict) and all(
        isinstance(record, dict)
        and isinstance(record.get("count"), int)
        and isinstance(record.get("total_s"), (int, float))
        and all(value is None or isinstance(value, (int, float)) for value in record.values())
        for record in phases.values()
    )


def job_record(sections, device_type):
    """A job's size (the walls of the stages' work, slowest worker) and its training steps."""
    size = sum(
        max((part.get("wall_s", 0.0) for part in section.get("workers", {}).values()), default=0.0)
        for section in sections.values()
    )
    steps = None
    for part in sections.get("training", {}).get("workers", {}).values():
        steps = add_steps(steps, step_summary(part.get("phases", {}), device_type))
    return {"size_s": size, "steps": steps}


# ---------------------------------------------------------------- the launch


def launch_record(info, profile, workers, device_type):
    """The launch's timings.json: every worker's phases, the jobs' sizes, the step shares and the advice."""
    jobs = {run: job for worker in workers for run, job in worker["jobs"].items()}
    steps = None
    for job in jobs.values():
        if job["steps"] is not None:
            steps = add_steps(steps, job["steps"])
    record = {
        **info,
        "profile": profile,
        "wall_s": max(worker["wall_s"] for worker in workers),
        "workers": {
            str(worker["rank"]): {"wall_s": worker["wall_s"], "phases": worker["phases"]} for worker in workers
        },
        "jobs": jobs,
        "steps": steps,
    }
    summed: dict[str, dict] = {}
    for worker in workers:
        add_phases(summed, worker["phases"])
    record["throughput"] = throughput(summed)
    record["advice"] = advise(
        info["parallel"], info["world_size"], [job["size_s"] for job in jobs.values()], communication_share(steps)
    )
    return record


def throughput(phases):
    """Per phase that counted its evaluations (the analysis' products): evaluations per second of the
    phase's time (device time where measured) and the rows each network call held."""
    rates = {}
    for name, phase in phases.items():
        seconds = phase.get("device_s") or phase.get("total_s")
        if not phase.get("evaluations") or not seconds:
            continue
        rates[name] = {"evaluations": phase["evaluations"], "evaluations_per_s": phase["evaluations"] / seconds}
        if phase.get("network_calls"):
            rates[name]["rows_per_call"] = phase["call_rows"] // phase["network_calls"]
    return rates


def table_lines(record, where):
    """The launch's phases as a short table: total, share of the workers' summed wall, count."""
    phases: dict[str, dict] = {}
    for worker in record["workers"].values():
        add_phases(phases, worker["phases"])
    wall = sum(worker["wall_s"] for worker in record["workers"].values()) or 1.0
    head = (
        f"timings: {len(record['workers'])} worker(s), {record['wall_s']:.1f} s wall, probes "
        f"{record['probes']}; every phase in {where}"
    )
    if not phases:
        why = "probes were off (NNPD_PROBES=off)" if record["probes"] == "off" else "no phase was timed"
        return [head, f"  {why}: only the jobs' wall times were measured"]
    device = any("device_s" in phase for phase in phases.values())
    columns = f"  {'phase':28s} {'total':>9s} {'share':>6s} {'count':>8s}"
    lines = [head, columns + (f" {'device':>9s}" if device else "")]
    ranked = sorted(phases.items(), key=lambda item: -item[1]["total_s"])
    for name, phase in ranked[:TABLE_ROWS]:
        row = f"  {name:28s} {phase['total_s']:8.2f}s {phase['total_s'] / wall:6.1%} {phase['count']:8d}"
        lines.append(row + (f" {phase['device_s']:8.2f}s" if "device_s" in phase else ""))
    rest = ranked[TABLE_ROWS:]
    if rest:
        lines.append(f"  ... {len(rest)} more phases, {sum(p['total_s'] for _, p in rest) / wall:.1%} together")
    for name, rate in record["throughput"].items():  # launch_record summed the same phases
        per_call = f", {rate['rows_per_call']:,} rows per network call" if "rows_per_call" in rate else ""
        lines.append(f"  {name}: {rate['evaluations_per_s']:.3g} evaluations/s{per_call}")
    lines.append("  (phases nest: communication within backward, products within metrics, commits within products)")
    return lines


# ---------------------------------------------------------------- advice


def communication_share(steps):
    """DDP communication's share of the training steps, or why it is unknown (a str)."""
    numbers = isinstance(steps, dict) and all(
        isinstance(steps.get(key), (int, float)) for key in ("step_s", "communicate_s")
    )
    if not numbers or not steps["step_s"] > 0:
        return "no training step was timed (models reused, or NNPD_PROBES=off)"
    if steps.get("device_type") == "cuda" and steps.get("clock") != "device":
        return "on CUDA the host clock misses the device's work; set NNPD_PROBES_CUDA=1 to measure it"
    return min(steps["communicate_s"] / steps["step_s"], 1.0)


def busy_share(sizes, workers):
    """How busy `workers` would be taking whole jobs of these sizes, largest first, as they free up."""
    loads = [0.0] * workers
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return sum(sizes) / (workers * max(loads)) if max(loads) > 0 else 1.0


def describe_jobs(sizes):
    """E.g. '4 jobs, the largest 1.3x the smallest'."""
    count = f"{len(sizes)} job{'s' if len(sizes) != 1 else ''}"
    if len(sizes) < 2 or min(sizes) <= 0:
        return count
    return f"{count}, the largest {max(sizes) / min(sizes):.1f}x the smallest"


def advise(parallel, world, sizes, communication):
    """One line: which runtime.parallel the next launch should use, and why.

    `communication` is DDP's share of each training step (a float) or why it is unknown (a str).
    """
    if not sizes:
        return "no jobs to time"
    jobs, workers = describe_jobs(sizes), max(world, 2)
    busy = busy_share(sizes, workers)
    measured = isinstance(communication, float)
    if world <= 1:
        if len(sizes) == 1:
            return (
                'one job on one worker: only runtime.parallel="ddp" under torchrun --nproc_per_node=W '
                "can share it between workers"
            )
        return (
            f'one worker takes the jobs in turn ({jobs}): runtime.parallel="jobs" under torchrun '
            f"--nproc_per_node=W (W up to {len(sizes)}) runs them side by side, keeping 2 workers about "
            f"{busy:.0%} busy"
        )
    if parallel == "ddp" and not measured:
        return (
            f'DDP\'s communication share is unknown ({communication}); runtime.parallel="jobs" would keep '
            f"the {world} workers about {busy:.0%} busy with {jobs}"
        )
    if parallel == "ddp" and busy > 1 - communication:
        return (
            f"DDP's gradient communication took {communication:.0%} of each training step; "
            f'runtime.parallel="jobs" would keep the {world} workers about {busy:.0%} busy with {jobs}, '
            "so it should be faster"
        )
    if parallel == "ddp":
        return (
            f'keep runtime.parallel="ddp": gradient communication took only {communication:.0%} of each '
            f'training step, while "jobs" would keep the {world} workers about {busy:.0%} busy with {jobs}'
        )
    if busy >= BUSY_ENOUGH:
        return f'keep runtime.parallel="jobs": it keeps the {world} workers about {busy:.0%} busy with {jobs}'
    return (
        f'runtime.parallel="jobs" keeps the {world} workers only about {busy:.0%} busy with {jobs}; '
        '"ddp" trains each model on all workers, worth it while gradient communication stays a small '
        "share of each step"
    )


def plan_advice(root, costs, runtime_settings):
    """The plan's advice: from the root's timings.json when there is one, else estimated from the workload."""
    path = Path(root) / FILE
    record = output_root.read_json(path, {}) if path.is_file() else {}
    parallel = runtime_settings.get("parallel", "jobs") if isinstance(runtime_settings, dict) else "jobs"
    if not record:
        line = advise(parallel, 1, list(costs.values()), "not measured yet")
        return f"estimated from the workload (no timings in {root} yet): {line}"
    jobs = record.get("jobs")
    jobs = jobs if isinstance(jobs, dict) else {}
    measured = {run: job.get("size_s") for run, job in jobs.items() if isinstance(job, dict)}
    known = all(isinstance(measured.get(run), (int, float)) for run in costs)
    sizes = [measured[run] for run in costs] if known else list(costs.values())
    world = record.get("world_size", 1) if isinstance(record.get("world_size"), int) else 1
    line = advise(record.get("parallel", parallel), world, sizes, communication_share(record.get("steps")))
    what = "measured" if known else "job sizes estimated from the workload, the rest measured"
    return f"{what} by the launch of {record.get('time', '?')} ({world} worker(s)): {line}"
