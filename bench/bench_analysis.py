"""One job's whole analysis (learned and exact products) against a plain forward pass, on cpu or cuda.

The analysis runs through the study kit's own driver (nre_analysis.summarise_cases, over
case_blocks' blocks, with learned_scoring and the exact likelihood), on the network and
settings of a bundled profile at a dimension (the default profile's mlp [64]*4; freshly
initialised: the rate depends on shapes, not weights). Side by side in one run,
alternating, it times:

  plain forward   the learned product's count of rows, already on the device, in calls of
                  the rows per call the analysis uses there;
  learned         the learned product (ratio and posterior): blocks of cases refined on
                  the device, many cases per network call;
  exact           the exact product (the likelihood, on the device too);

and prints model evaluations per second (per CPU-second on the CPU, where nnpd analyses
with one thread), the learned product's ratio to the plain forward pass (target >= 0.9),
the rows per network call, and on CUDA the share of the device's peak FP32 rate (the
peak measured in the same run by a large float32 matrix product). On the CPU it then
measures the ratio a second way, immune to the shared machine's speed drifting from one
run to the next: the learned product again, with a plain forward call on pre-built rows,
timed on its own, before each of its network calls.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import adaptive  # noqa: E402
import case_blocks  # noqa: E402
import case_scores  # noqa: E402
import designs  # noqa: E402
import gaussian  # noqa: E402
import gaussian_study  # noqa: E402
import networks  # noqa: E402
import nre_analysis  # noqa: E402
import priors  # noqa: E402
import runtime  # noqa: E402
import settings  # noqa: E402
import settings_analysis  # noqa: E402
import settings_training  # noqa: E402


class MemoryWriter:
    """The two writer calls the study's drivers make, kept in memory instead of a store."""

    def __init__(self):
        self.arrays = {}

    def allocate(self, key, shape, dtype):
        """A zeroed array the driver fills in place."""
        self.arrays[key] = np.zeros(shape, dtype)
        return self.arrays[key]

    def array(self, key, value):
        """Keep a finished array."""
        self.arrays[key] = np.asarray(value)


def profile_inputs(profile, dimension, cases):
    """The profile's problem, uniform prior, network settings, inference settings, truths and observations."""
    training = settings.resolve(settings_training.make_settings(profile))
    training["problem"]["dimension"] = dimension
    problem = gaussian.GaussianProblem.from_settings(training["problem"])
    prior = priors.make_prior(problem, training["priors"]["uniform"])
    analysis = settings_analysis.make_settings(profile)["inference"]
    truths = designs.make_truths(problem.low, problem.high, problem.grid_step, analysis["truths"], 1)[:cases]
    observations = designs.make_observations(problem.simulate, truths, analysis["observations"], 2)
    return problem, prior, training, analysis, truths.contiguous(), observations.contiguous()


class Job:
    """One profile's analysis of `cases` cases with a model on a device, as the study runs it."""

    def __init__(self, device, profile, dimension, cases, precision):
        self.problem, self.prior, training, self.settings, self.truths, self.observations = profile_inputs(
            profile, dimension, cases
        )
        self.settings["precision"] = precision
        self.device = device
        self.input_size = self.problem.dimension + self.problem.parameter_count
        torch.manual_seed(0)
        # The bundled study's own network (it does not standardise its inputs).
        self.model = (
            networks.build_network(training["model"], self.input_size, gaussian_study.GaussianExperiment.standardize)
            .to(device)
            .eval()
        )
        self.targets = [t for t in ("ratio", "posterior") if t in self.settings["targets"]]
        candidates, p = self.settings["candidates"], self.problem.parameter_count
        lattice = designs.candidate_lattice(self.prior.lattice_steps, p, candidates)
        self.design = designs.make_candidates(self.problem.low, self.problem.high, lattice, candidates, 3)
        self.adaptive = candidates["kind"] == "adaptive"
        self.box, self.lattice = adaptive.support_box(self.problem.low, self.problem.high, lattice), lattice
        # Model rows the learned product evaluates: every case's points and its truth, each observation.
        self.rows = (
            self.truths.shape[0]
            * self.observations.shape[1]
            * (
                designs.points_per_case(p, lattice, self.problem.low, self.problem.high, candidates, len(self.targets))
                + 1
            )
        )
        self.rows_per_call = case_scores.call_policy(
            device.type, self.settings["chunk_rows"], case_scores.network_row_bytes(self.model, self.input_size)
        ).rows_per_call

    def summarise(self, targets, scoring):
        """Every case through the study's driver for `targets`."""
        sizes = None
        if self.adaptive:
            sizes = designs.adaptive_sizes(self.problem.parameter_count, self.settings["candidates"], len(targets))
        design = case_blocks.Design(
            self.settings["candidates"]["kind"],
            self.lattice,
            adaptive.Refinement(self.box, self.settings["levels"], sizes, 4),
        )
        # Keep nothing: the bench times the work, not the store.
        work = nre_analysis.Cases(
            targets, self.truths, case_blocks.Candidates(*self.design), {"mode": "diagnostic", "cases": 0}
        )
        nre_analysis.summarise_cases(MemoryWriter(), scoring, design, work, lambda case: None)

    def learned(self):
        """The learned product; returns the model rows evaluated and the rows per call."""
        counted = case_scores.Evaluations()
        scoring = case_blocks.learned_scoring(
            self.model, self.device, self.prior, self.observations, self.targets, self.settings, counted
        )
        self.summarise(self.targets, scoring)
        synchronize(self.device)
        return counted.rows, counted.call_rows // max(counted.calls, 1)

    def exact(self):
        """The exact product; returns the likelihood terms evaluated."""
        counted = case_scores.Evaluations()
        self.summarise(
            ["exact"],
            case_blocks.exact_scoring(
                self.problem.log_likelihood, self.observations, self.device, self.settings["chunk_rows"], counted
            ),
        )
        synchronize(self.device)
        return counted.rows, None

    def flops_per_evaluation(self):
        """Multiply-adds × 2 of one network row: its Linear layers."""
        return sum(2 * m.in_features * m.out_features for m in self.model.modules() if isinstance(m, torch.nn.Linear))


def synchronize(device):
    """Wait for the device, so a timing holds all of its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_forward(model, rows, rows_per_call):
    """A plain batched forward pass over pre-built rows; returns the rows evaluated."""
    total = torch.zeros((), device=rows.device)
    for chunk in rows.split(rows_per_call):
        total += model(chunk).sum()
    total.item()  # waits for the device
    return rows.shape[0], rows_per_call


def peak_fp32(device, size=8192, repeats=5):
    """The device's FP32 rate (FLOP/s) measured by a large float32 matrix product, TF32 off."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        torch.mm(a, b)
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        synchronize(device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def clock(device):
    """The clock a rate is measured on: CPU time on the CPU (one thread), wall time on CUDA."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def measure(runs, repeats, now):
    """Alternate the runs `repeats` times after one untimed warm-up each.

    Returns ({name: seconds}, {name: (rows, per call)}).
    """
    with torch.no_grad():
        counts = {name: run() for name, run in runs.items()}
        seconds = {name: [] for name in runs}
        for repeat in range(repeats):
            # Alternate which goes first, so a drift of the machine's speed favours none.
            for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
                started = now()
                counts[name] = runs[name]()
                seconds[name].append(now() - started)
    return seconds, counts


class InterleavedForward(torch.nn.Module):
    """The job's network, with one plain forward call on pre-built rows, timed on its own, before
    each call the analysis makes: both then run through the same moments of the machine's speed."""

    def __init__(self, model, rows, rows_per_call, now):
        super().__init__()
        self.model, self.chunks, self.now = model, itertools.cycle(rows.split(rows_per_call)), now
        self.seconds, self.rows = 0.0, 0

    def forward(self, inputs):
        """The plain call (timed, its rows counted), then the analysis' own."""
        chunk = next(self.chunks)
        started = self.now()
        self.model(chunk).sum()
        self.seconds += self.now() - started
        self.rows += chunk.shape[0]
        return self.model(inputs)


def interleaved_ratios(job, rows, repeats, now):
    """The learned product's rate over the plain forward pass's, with a plain call before each of
    its network calls (CPU only: on CUDA the timing of one call would need a synchronisation)."""
    model, ratios = job.model, []
    try:
        for _ in range(repeats):
            job.model = InterleavedForward(model, rows, job.rows_per_call, now)
            started = now()
            learned_rows, _ = job.learned()
            learned_seconds = now() - started - job.model.seconds
            ratios.append((learned_rows / learned_seconds) / (job.model.rows / job.model.seconds))
    finally:
        job.model = model
    return sorted(ratios)


def report(job, seconds, counts, repeats, peak):
    """Print each rate (best of the repeats), the learned product's ratio and, on CUDA, its share of the peak."""
    unit = "CPU-second" if job.device.type == "cpu" else "second"
    rates = {name: counts[name][0] / min(values) for name, values in seconds.items()}
    for name, rate in rates.items():
        per_call = f", {counts[name][1]:,} rows per call" if counts[name][1] else ""
        what = "likelihood terms" if name == "exact" else "model evaluations"
        print(
            f"{name:14s} {rate / 1e6:9.3f} M {what}/{unit}  ({counts[name][0]:,} per run{per_call}, best of {repeats})"
        )
    paired = sorted(
        (counts["learned"][0] / a) / (counts["plain forward"][0] / f)
        for a, f in zip(seconds["learned"], seconds["plain forward"])
    )
    ratio = rates["learned"] / rates["plain forward"]
    print(f"ratio learned / plain forward: best-of {ratio:.3f}, median of pairs {paired[len(paired) // 2]:.3f}")
    share = ""
    if peak:
        achieved = rates["learned"] * job.flops_per_evaluation()
        share = f", {achieved / peak:.1%} of the measured FP32 peak ({peak / 1e12:.1f} TFLOP/s)"
        print(f"learned product: {achieved / 1e12:.2f} TFLOP/s{share}")
    # One line for bench/gpu_checks.sh's summary table.
    print(
        f"figure: plain forward {rates['plain forward'] / 1e6:.3g} M/s, learned {rates['learned'] / 1e6:.3g} M/s, "
        f"ratio {ratio:.3f}, {counts['learned'][1]:,} rows per call{share}"
    )
    return rates


def main(argv=None):
    """Build the network and the profile's cases, then time and print the rates."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (as runtime.device)")
    parser.add_argument(
        "--profile",
        default="default",
        choices=["default", "paper"],
        help="default: adaptive candidates; paper: a fixed Sobol design",
    )
    parser.add_argument("--dimension", type=int, default=6, help="problem dimension (6: input width 12)")
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="float32", choices=["float32", "tf32", "bfloat16"])
    arguments = parser.parse_args(argv)
    training = settings.resolve(settings_training.make_settings(arguments.profile))
    # The analysis runs under the training's runtime section: one CPU thread, deterministic.
    rt = runtime.start(dict(training["runtime"], device=arguments.device, parallel="jobs"))
    try:
        job = Job(rt.device, arguments.profile, arguments.dimension, arguments.cases, arguments.precision)
        with torch.no_grad():
            built = torch.randn(job.rows, job.input_size, device=rt.device)  # as many rows as the learned product
        print(
            f"device {rt.device}, profile {arguments.profile}, dimension {arguments.dimension}, "
            f"{job.truths.shape[0]} cases, {job.observations.shape[1]} observations, precision "
            f"{arguments.precision}, {job.flops_per_evaluation():,} FLOP per model evaluation"
        )
        runs = {
            "plain forward": lambda: plain_forward(job.model, built, job.rows_per_call),
            "learned": job.learned,
            "exact": job.exact,
        }
        seconds, counts = measure(runs, arguments.repeats, clock(rt.device))
        peak = peak_fp32(rt.device) if rt.device.type == "cuda" else None
        rates = report(job, seconds, counts, arguments.repeats, peak)
        if rt.device.type == "cpu":
            with torch.no_grad():
                ratios = interleaved_ratios(job, built, arguments.repeats, clock(rt.device))
            print(
                f"ratio learned / plain forward, a plain call before each of its calls: median "
                f"{ratios[len(ratios) // 2]:.3f}, all {' '.join(f'{r:.3f}' for r in ratios)}"
            )
        return rates
    finally:
        runtime.stop(rt)


if __name__ == "__main__":
    main()
