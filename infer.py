"""`python nnpd.py infer RUN --observations FILE.npy`: a trained model's posterior for your observation.

Writes, beside the observations file (or into `--output`), `<stem>-<member>.posterior.json`
(mode, mean, sd, HPD bounds per level, effective sample size), `<stem>-<member>.samples.npy`
and with `--plot` `<stem>-<member>.corner.png`. The observations are one observation (d,)
or an ensemble of m observations (m, d) of the same parameters; `--truth FILE.npy` (p,)
marks known parameters on the corner plot. A bad file or shape changes nothing on disk.
A nearly flat posterior (Posterior.flatness) gets one line saying so, kept under "flat" in
the JSON too: the lines of the posterior's own warnings (Posterior.warnings), which
`restore(run).posterior` gives a Python user as PosteriorWarnings. A run only trained, never
analysed, is scored with the study's default analysis settings on posterior.POSTERIOR_CANDIDATES'
design. One line says how the samples were drawn
(Posterior.sampling), with a warning when they could not be made independent; with
`--reference FILE.npy` (n, p) draws of a reference posterior, one line gives the C2ST of the
samples against them (0.5: indistinguishable; c2st.py) on sets of equal size, the larger one
subsampled, kept under "c2st" (and the size under "c2st_draws") in the JSON. `--output` is
followed through links before the check that it lies outside every output root.
"""

import io
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np

import runtime
import study
from c2st import c2st
from store import ROOT_MARKER, NnpdError, irregular_file, read_npy, restore, write_bytes_atomic

__all__ = ["InferError", "add_arguments", "command"]

DEFAULT_SAMPLES = 1000
MAX_SAMPLES = 10**7  # samples infer draws at most (10^7 rows of p float64 fit in memory for modest p)


class InferError(NnpdError):
    """Input the infer command cannot use: the message names the file and what is expected."""


def add_arguments(parser):
    """The infer command's arguments, beside the command line's own."""
    parser.add_argument(
        "run", nargs="?", help="infer: the run folder (outputs/<profile>/runs/<configuration>/<member>)"
    )
    parser.add_argument("--observations", metavar="FILE.npy", help="infer: the observation (d,) or ensemble (m, d)")
    parser.add_argument("--truth", metavar="FILE.npy", help="infer: known parameters (p,) to mark on the corner plot")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="infer: posterior samples to draw")
    parser.add_argument("--output", metavar="DIR", help="infer: where to write (default: beside the observations)")
    parser.add_argument(
        "--reference",
        metavar="FILE.npy",
        help="infer: reference posterior draws (n, p) to score the samples against (C2ST)",
    )


def read_array(path, what):
    """A real numeric array from a regular .npy file, or an InferError naming the file.

    The file's type is checked before it is opened (a FIFO would block the open for ever),
    and its header's size and dtype before its data are read (store.read_npy).
    """
    problem = irregular_file(path)
    if problem is not None:
        raise InferError(f"{what} {path}: {problem}; give a .npy file saved with numpy.save")
    try:
        with open(path, "rb") as stream:
            array = read_npy(stream)
    except (OSError, ValueError, EOFError) as error:
        raise InferError(
            f"{what} {path}: not a readable .npy file of numbers ({error}); save one with numpy.save"
        ) from None
    if not np.isfinite(array).all():
        raise InferError(f"{what} {path}: holds NaN or infinite values")
    return array


def output_folder(arguments):
    """Where infer writes: an existing folder, or one to make, never inside an nnpd output root."""
    folder = Path(arguments.output) if arguments.output else Path(arguments.observations).parent
    if folder.exists() and not folder.is_dir():
        raise InferError(f"--output {folder}: exists and is not a folder; name a folder")
    real = Path(os.path.realpath(folder))  # a link must not lead into the root (its cache) unseen
    for place in (real, *real.parents):
        if (place / ROOT_MARKER).is_file():
            raise InferError(
                f"{folder}: inside the output root {place}, which nnpd manages; write elsewhere (--output DIR)"
            )
    return folder


def file_stem(observations, member):
    """`<observations' stem>-<member>`, the member's name cut to safe characters (it comes from run.json)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(member)).strip(".") or "run"
    return f"{Path(observations).stem}-{name.replace('..', '_')}"


def command(arguments):
    """The infer command: its files, or one line saying what is wrong with the input (exit status 2)."""
    try:
        written, lines = infer(arguments)
        print("\n".join([f"written: {path}" for path in written] + lines))
    except KeyboardInterrupt:  # a stop is an NnpdError too, but not one to answer with exit status 2
        raise
    # Only nnpd's own errors are the user's to fix: a TypeError or a bare ValueError from the
    # study's code is a bug, and stays a traceback rather than a misleading one-line answer.
    except NnpdError as error:
        if runtime.STOP.requested is not None:  # raised after a stop the study's code swallowed: that stop
            raise
        print(f"nnpd: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


def infer(arguments):
    """Compute the posterior and write its files; returns the paths written and the lines to print."""
    if not arguments.run or not arguments.observations:
        raise InferError("infer needs a run folder and --observations FILE.npy")
    if not 1 <= arguments.samples <= MAX_SAMPLES:
        raise InferError(f"--samples {arguments.samples}: draw from 1 to {MAX_SAMPLES:,} samples")
    observations = read_array(arguments.observations, "--observations")
    truth = read_array(arguments.truth, "--truth") if arguments.truth else None
    reference = read_array(arguments.reference, "--reference") if arguments.reference else None
    folder = output_folder(arguments)
    restored = restore(arguments.run)  # its errors (NnpdError) name the run folder or file
    stem = folder / file_stem(arguments.observations, restored.member.get("name", "run"))
    paths = output_paths(stem, arguments.plot)  # refused before any work, not after it
    progress = study.Progress(
        lambda line: print(f"nnpd: {line}", file=sys.stderr, flush=True),
        f"infer {restored.run_dir.name}",
        unit="points",
    )
    with study.progress_to(progress):  # a large ensemble's posterior takes a while: say how far it is
        posterior, samples = posterior_samples(restored, observations, truth, reference, arguments)
    figure = corner_png(posterior, samples, truth, run_label(restored)) if arguments.plot else None
    summary = {
        "run": str(restored.run_dir),
        "observations": str(arguments.observations),
        "shape": list(observations.shape),
        "samples": int(arguments.samples),
        **posterior.summary(),
        "flat": posterior.flat,
        "sampling": posterior.sampling,
    }
    if reference is not None:
        summary["c2st"], summary["c2st_draws"] = equal_size_c2st(samples, reference)
    return write_outputs(paths, summary, samples, figure), report_lines(summary, posterior.warnings, reference)


def equal_size_c2st(samples, reference):
    """The C2ST of the samples against the reference on sets of equal size, the larger one subsampled (seeded),
    and that size.

    On unequal sets a classifier scores the larger share by guessing its label: 500 draws of
    the very posterior against 5,000 read 0.909, not the 0.5 that means indistinguishable.
    """
    size = min(len(samples), len(reference))
    generator = np.random.default_rng(0)
    mine, theirs = (
        array if len(array) == size else array[np.sort(generator.choice(len(array), size, replace=False))]
        for array in (samples, reference)
    )
    return c2st(mine, theirs, seed=0), size


def posterior_samples(restored, observations, truth, reference, arguments):
    """The run's posterior for the observations and its samples; a shape that does not fit is an InferError."""
    with warnings.catch_warnings():  # infer prints the posterior's warnings as lines of its own
        warnings.simplefilter("ignore")
        posterior = restored.posterior(observations)  # a bad observation is its PosteriorError
    p, names = len(posterior.names), ", ".join(posterior.names)
    if truth is not None and truth.shape != (p,):
        raise InferError(f"--truth {arguments.truth}: shape {truth.shape}, expected ({p},) for {names}")
    if reference is not None and (reference.ndim != 2 or reference.shape[1] != p or reference.shape[0] < 10):
        raise InferError(
            f"--reference {arguments.reference}: shape {reference.shape}, expected (n, {p}) draws, n >= 10, for {names}"
        )
    with warnings.catch_warnings():  # the sampling line says it once
        warnings.simplefilter("ignore")
        return posterior, posterior.sample(arguments.samples, seed=0).numpy()


def output_paths(stem, plot):
    """The summary JSON, the samples and (with --plot) the corner plot's paths; one that is there and is not a
    file (the atomic rename would fail on a folder) is an InferError."""
    paths = [stem.with_name(f"{stem.name}.{suffix}") for suffix in ("posterior.json", "samples.npy", "corner.png")]
    paths = paths if plot else paths[:2]
    for path in paths:
        if os.path.lexists(path) and not os.path.isfile(path):
            raise InferError(f"{path}: exists and is not a file; move it, or write elsewhere (--output DIR)")
    return paths


def write_outputs(paths, summary, samples, figure):
    """The summary JSON, the samples and the corner plot (drawn with --plot), each written atomically to
    output_paths()'s paths; those paths."""
    write_bytes_atomic(paths[0], (json.dumps(summary, indent=2) + "\n").encode())
    buffer = io.BytesIO()
    np.save(buffer, samples)
    write_bytes_atomic(paths[1], buffer.getvalue())
    if figure is not None:
        write_bytes_atomic(paths[2], figure)
    return paths


def report_lines(summary, warned, reference):
    """What infer prints besides the files: how it sampled, the posterior's warnings, the C2ST against a reference."""
    sampling = summary["sampling"]
    line = f"samples: {sampling['draws']} by {sampling['method']}, {sampling['distinct_fraction']:.0%} distinct"
    if sampling["acceptance"] is not None:
        line += f", acceptance {sampling['acceptance']:.2g} of {sampling['evaluations']} proposal evaluations"
    if sampling.get("path"):  # which path placed the proposal (sampler.py): the candidates or PMC passes
        source = "the candidates" if sampling["path"] == "candidates" else sampling["path"]
        passes = f" ({sampling['passes']} passes)" if sampling["passes"] else ""
        line += f"; proposal from {source}{passes}, {sampling['effective']:.0f} effective draws"
    lines = [line] + [f"warning: {text}" for text in warned]
    if reference is not None:
        size = summary["c2st_draws"]
        lines.append(
            f"c2st: {summary['c2st']:.3f}, {size} samples against {size} of the {len(reference)} reference "
            "draws (sets of equal size; 0.5: indistinguishable)"
        )
    return lines


def run_label(restored):
    """(run, prior) naming a restored run on its corner plot: '<configuration folder>/<run folder>' and the prior."""
    run_dir = Path(restored.run_dir)
    return f"{run_dir.parent.name}/{run_dir.name}", str(restored.member.get("prior", restored.member.get("name")))


def corner_png(posterior, samples, truth, label=(None, None)):
    """The corner plot as PNG bytes (needs matplotlib), titled with the (run, prior) of `label`."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise InferError("--plot needs matplotlib (pip install matplotlib)") from None
    size = max(5.0, 2.5 * len(posterior.names) + 1.5)
    figure = Figure(figsize=(size, size), layout="constrained")
    posterior.draw_corner(figure, samples, truth, run=label[0], prior=label[1])
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()
