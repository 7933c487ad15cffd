"""The study kit: a neural-ratio-estimation study from a page of science.

A study subclasses `Study` and declares only its science:

    class Pendulum(nre_study.Study):
        parameters = {"length": (0.5, 2.0), "damping": (0.0, 0.5, 0.05)}   # box, optional lattice step

        def simulate(self, theta, generator):          # (n, p) float64 -> (n, d), seeded by generator
            ...

        def log_likelihood(self, x, theta):            # optional: exact log p(x | θ), broadcasting
            ...

The settings name it (`"experiment": "pendulum:Pendulum"`) with the kit's analysis
(`"analysis": "nre_analysis:NREAnalysis"`), and nnpd supplies the rest: the cohort (each
prior of `cohort.priors` times `cohort.replicas`), the bundled prior families by name
(`uniform`, `normal`, `exponential`, `grid`; see priors.py) or a study's own prior objects
(`custom_priors = {"name": object}` on the class), the training data (every simulation a
joint pair, re-paired with other rows' θ in every batch: contrast.py), the network
(networks.py, inputs standardised on the training data unless `model.standardize` is
False; a study's own embedding network for x in front of it, `Study.embedding`), training
through the bundled trainer with a measured default recipe (`KIT_MODEL`, `KIT_TRAINING`;
docs/training.md), and the whole analysis (nre_analysis.py).
docs/extending.md walks through a complete example.

Training settings sections: `data` (`train`, `validation`; `test` defaults to validation's size), and
optionally `cohort` and `priors` (without them `KIT_COHORT`, `KIT_PRIORS`: one member, a uniform prior over
the box), `model` (the whole network; without it `KIT_MODEL`), `training` (the keys it names replace
`KIT_TRAINING`'s) and a `problem` of the study's own (`self.settings["problem"]`, part of every key).
"""

import hashlib
import math
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import numpy as np
import torch

import contrast
import networks
import output_root
import posterior
import priors
import rounds
import runtime
import study
import trainer
from settings import SettingsError, integer, known_keys, name_list, number, one_of, require
from store import canonical_json, irregular_file, read_npy
from study import Experiment, Json, Member, PriorContract, ProblemContract

__all__ = [
    "SPLITS",
    "SIMULATION_CHUNK",
    "KIT_MODEL",
    "KIT_TRAINING",
    "KIT_COHORT",
    "KIT_PRIORS",
    "with_kit_defaults",
    "DataSettings",
    "Problem",
    "sample_joint",
    "sample_pairs",
    "sample_training_data",
    "Study",
]

SPLITS = ("train", "validation", "test")
# Rows plan simulates to check a simulator: a shape or type that changes with n shows on more
# than two (docs/extending.md, the simulator's contract).
CHECK_ROWS = 16
SIMULATION_CHUNK = 4096  # simulations per simulator call: progress between calls, and bounded memory
MAX_ROWS = 10**9
# "batch": data.* count simulations, each a joint pair re-paired in every batch (contrast.py);
# "fixed": the earlier meaning, half joint and half product pairs, each a simulation, fixed for every epoch.
PAIRINGS = ("batch", "fixed")
NPY_MAGIC = b"\x93NUMPY"
FLOAT32_MAX = float(np.finfo(np.float32).max)  # x and θ train as float32: beyond it they become inf
BOX_DRAWS = 20_000  # prior draws plan checks against the parameter box
BOX_MASS_WARNING = 0.001  # the share outside the box above which plan warns (a prior's draws, a bank's θ)
# A bank with more than this share of its θ outside the box is refused: the network would
# then train mostly where no posterior is computed; for banks, see
# docs/training.md, "What `data` counts: simulations, each a joint pair used twice".
BANK_OUTSIDE_LIMIT = 0.5
DATA_KEYS = SPLITS + ("pairing", "bank", "invalid")


class DataSettings(TypedDict):
    """The kit's `data` section as the code reads it (check_cohort checks it): mypy names a misspelt key."""

    train: int  # simulator calls per split
    validation: int
    test: int  # with_kit_defaults fills it: as many as validation
    pairing: NotRequired[str]  # "batch" (the default) or "fixed"
    invalid: NotRequired[str]  # "error" (the default) or "drop"
    bank: NotRequired[Any]  # a .npz of simulations in place of the simulator, or None


# data.invalid: what a simulation with a NaN or infinite number does, "error" (the sampling
# fails, naming the share and a θ) or "drop" (the others are kept; data.* still count calls).
INVALID = ("error", "drop")
# The network and training a study gets when it writes no `model` / `training` section: chosen
# on the posterior-quality benchmark (bench/bench_posterior_quality.py; docs/training.md).
# GELU, not ReLU: a ReLU network's logit is piecewise linear in θ, so the log posterior it
# gives is too; a smooth one follows a curved log posterior with the same simulations.
KIT_MODEL = {"kind": "residual", "width": 50, "blocks": 2, "activation": "gelu"}
KIT_TRAINING = {
    "objective": "contrastive",
    "classes": 10,
    "gamma": 1.0,
    "selection": "objective",
    "batch_size": 200,
    "learning_rate": 5e-4,
    "epochs": 500,
    "patience": 50,  # 20 ended training while the validation loss still fell in small steps (docs/training.md)
}
# The cohort a study gets when it writes no `cohort` / `priors` section: one member, a uniform prior over the box.
KIT_COHORT = {"priors": ["uniform"], "replicas": 1}
KIT_PRIORS = {"uniform": {"family": "uniform"}}


class Problem:
    """The parameters and simulator of a study, in the form the analysis reads.

    `names`, `low`, `high` (float64 (p,)), `grid_step` ((p,), or None unless every
    parameter has a lattice step), `dimension` (of one observation), `simulate(theta,
    generator)` (None for a study trained on a bank alone), `log_likelihood(x, theta)`
    (None without one) and `parameter(name)`:
    the box and the bundled priors' hyper-parameters of one parameter.
    """

    def __init__(self, parameters, simulate, log_likelihood, where, dimension=None):
        """Check the declared parameters and find the observation's dimension by one simulation (or take it)."""
        if not isinstance(parameters, dict) or not parameters:
            raise SettingsError(
                f"{where}.parameters: declare the parameters as {{name: (low, high)}} "
                "or {name: (low, high, lattice step)}"
            )
        self._parameters = {name: parameter_values(name, value, where) for name, value in parameters.items()}
        self.names = list(self._parameters)
        self.parameter_count = len(self.names)
        self.low = torch.tensor([v["low"] for v in self._parameters.values()], dtype=torch.float64)
        self.high = torch.tensor([v["high"] for v in self._parameters.values()], dtype=torch.float64)
        steps = [v["grid_step"] for v in self._parameters.values()]
        self.grid_step = None if None in steps else torch.tensor(steps, dtype=torch.float64)
        self.where, self._simulator, self.dimension = where, simulate, None
        self.simulate = None if simulate is None else self.checked_simulate
        self.log_likelihood = log_likelihood
        found = None if simulate is None else observation_dimension(self.simulate, (self.low + self.high) / 2, where)
        if None not in (found, dimension) and found != dimension:
            raise SettingsError(
                f"data.bank: its x has {dimension} numbers per row where {where}.simulate returns {found}"
            )
        self.dimension = found or dimension

    def checked_simulate(self, theta, generator):
        """The study's simulate, its every result checked (checked_simulation): a wrong shape is one line."""
        return checked_simulation(self._simulator, theta, generator, self.where, self.dimension)

    def parameter(self, name):
        """The box and prior hyper-parameters of one parameter."""
        return dict(self._parameters[name])

    def describe(self):
        """JSON-able: the parameters and the observation's dimension."""
        return {"parameters": {name: self.parameter(name) for name in self.names}, "dimension": self.dimension}


def parameter_values(name, value, where):
    """One declared parameter, (low, high[, step]) or a dict, with the bundled priors' defaults filled in.

    Defaults: a normal prior centred in the box with a quarter of its width as sd, an
    exponential one decaying over the box's width, and no lattice.
    """
    path = f"{where}.parameters[{name!r}]"
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        value = dict(zip(("low", "high", "grid_step"), value))
    if not isinstance(value, dict):
        raise SettingsError(f"{path}: expected (low, high), (low, high, step) or a dict, got {value!r}")
    known_keys(value, priors.PARAMETER_KEYS, path)
    # θ trains as float32: a bound beyond its range would become infinite there.
    low = number(require(value, "low", path), f"{path}.low", -FLOAT32_MAX, FLOAT32_MAX)
    high = number(require(value, "high", path), f"{path}.high", -FLOAT32_MAX, FLOAT32_MAX)
    if not high > low:
        raise SettingsError(f"{path}: high ({high:g}) must be above low ({low:g})")
    width = high - low
    values = {
        "low": low,
        "high": high,
        "normal_mean": (low + high) / 2,
        "normal_std": width / 4,
        "exponential_rate": 1 / width,
        "grid_step": None,
        **value,
    }
    number(values["normal_mean"], f"{path}.normal_mean")
    number(values["normal_std"], f"{path}.normal_std", 0, math.inf, low_open=True)
    number(values["exponential_rate"], f"{path}.exponential_rate")
    if values["grid_step"] is not None and not 0 < number(values["grid_step"], f"{path}.grid_step") <= width:
        raise SettingsError(f"{path}.grid_step: a lattice step in (0, {width:g}] (the box's width)")
    return values


def observation_dimension(simulate, theta, where):
    """The width d of one observation, from simulating CHECK_ROWS rows twice with one seed, and one row.

    A wrong shape or type names the study; so does a simulator whose draws do not follow its
    generator (it draws from torch's or numpy's global stream), which would silently break
    every cached and resumed result (docs/extending.md shows the seeding wrapper).
    """
    rows = theta.expand(CHECK_ROWS, -1).clone()
    if not follows_its_generator(lambda generator: simulate(rows, generator)):
        raise SettingsError(
            f"{where}.simulate: two calls with generators of the same seed gave different "
            "observations; draw every random number from the `generator` argument (for a simulator "
            "on torch's or numpy's global stream, see "
            'docs/extending.md, "Simulators on a global stream")'
        )
    dimension = int(simulate(rows, torch.Generator().manual_seed(0)).shape[1])
    one = simulate(rows[:1], torch.Generator().manual_seed(0))  # an analysis may simulate one row at a time
    if one.shape[1] != dimension:
        raise SettingsError(
            f"{where}.simulate: returned {dimension} numbers per row for {CHECK_ROWS} rows but "
            f"{one.shape[1]} for 1; return the same observation width d for any number of rows"
        )
    return dimension


def follows_its_generator(draw):
    """Whether draw(generator) gives the same tensor for two generators of one seed, the global streams moved
    between the calls (and put back): a draw from torch's or numpy's global stream differs."""
    first = draw(torch.Generator().manual_seed(0))
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.rand(1)
        np.random.random_sample()
        again = draw(torch.Generator().manual_seed(0))
    np.random.set_state(numpy_state)
    return same_values(again, first)


def same_values(a, b):
    """Whether two tensors hold the same values, NaN where the other has NaN (tensors of another shape differ)."""
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_custom_prior(prior, name, kind):
    """A study's own prior object (of class `kind`, as priors.CustomPrior wraps it) at plan: finite draws
    from its generator, and a JSON describe().

    Like a simulator's, its draws must follow the `generator` argument, or two fresh roots
    would key the same data to different θ.
    """
    where = f"priors.{name} ({kind})"
    draws = prior.sample(CHECK_ROWS, torch.Generator().manual_seed(0))
    if not bool(torch.isfinite(draws).all()):
        raise SettingsError(f"{where}: sample() drew NaN or infinite θ; draw finite parameters")
    if not follows_its_generator(lambda generator: prior.sample(CHECK_ROWS, generator)):
        raise SettingsError(
            f"{where}: two sample() calls with generators of the same seed drew different θ; draw "
            "every random number from the `generator` argument "
            '(docs/extending.md, "The kit\'s declarations")'
        )
    try:
        canonical_json(prior.describe())
    except (TypeError, ValueError) as error:
        raise SettingsError(
            f"{where}: describe() returned a value JSON cannot hold ({error}); return a dict of "
            "numbers, strings, lists and dicts"
        ) from None


def checked_simulation(simulate, theta, generator, where, dimension=None):
    """simulate(theta, generator), refused in one line unless a real tensor (n, d) (d = `dimension` when
    given) that left θ as it was: the trainer would otherwise fail in torch's words, or train on a changed θ."""
    kept = theta.clone()
    x = simulate(theta, generator)
    n = len(theta)
    if not same_values(theta, kept):
        raise SettingsError(
            f"{where}.simulate changed its θ argument in place; work on a copy (theta = "
            "theta.clone()), since the same θ become the training pairs"
        )
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 2
        or x.shape[0] != n
        or x.shape[1] == 0
        or dimension not in (None, x.shape[1])
    ):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        width = "d" if dimension is None else str(dimension)
        raise SettingsError(
            f"{where}.simulate: for {n} parameter rows it returned {shape}; it must return a tensor "
            f"({n}, {width}), one observation of {width} numbers per row, for any n"
        )
    if x.is_complex():  # .to(float32) would keep the real part alone, with only a warning
        raise SettingsError(
            f"{where}.simulate: returned {x.dtype} values; return real numbers (for a complex "
            "signal, its real and imaginary parts side by side: torch.view_as_real(x).flatten(1))"
        )
    return x


def sample_joint(problem, prior, rows, generator):
    """`rows` simulations: θ from the prior, x simulated at it; float32 (x, θ) as the trainer reads them."""
    theta = prior.sample(rows, generator)
    x = problem.simulate(theta, generator)
    return x.to(torch.float32), theta.to(torch.float32)


def simulate_split(problem, prior, rows, seed, split):
    """A split's joint simulations, SIMULATION_CHUNK rows per simulator call, each chunk from its own
    stream (the first from the split's), with progress reported between calls."""
    parts = []
    study.report_progress(f"data.{split}", 0, rows)  # the clock of its rate starts here
    for chunk, start in enumerate(range(0, rows, SIMULATION_CHUNK)):
        labels = ("split", split) if chunk == 0 else ("split", split, "chunk", chunk)
        parts.append(
            sample_joint(problem, prior, min(SIMULATION_CHUNK, rows - start), runtime.seeded_generator(seed, *labels))
        )
        if not bool(torch.isfinite(parts[-1][1]).all()):  # not the simulator's failure: the prior's
            raise SettingsError(
                f"data.{split}: the prior ({type(getattr(prior, 'prior', prior)).__name__}) drew NaN "
                "or infinite θ; fix its sample() to draw finite parameters"
            )
        study.report_progress(f"data.{split}", start + len(parts[-1][0]), rows)
    return torch.cat([x for x, _ in parts]), torch.cat([theta for _, theta in parts])


def sample_pairs(problem, prior, rows, generator):
    """Balanced, shuffled joint (label 1) and product (label 0) pairs: inputs [x, theta].

    Joint pairs simulate x at their own θ; product pairs put x simulated at one prior draw
    beside an independent one, so the classifier learns p(x|θ)/p(x).
    """
    half = check_rows(rows, "rows") // 2
    theta_joint = prior.sample(half, generator)
    x_joint = problem.simulate(theta_joint, generator)
    theta_product = prior.sample(half, generator)
    x_product = problem.simulate(prior.sample(half, generator), generator)
    x = torch.cat([x_joint, x_product])
    theta = torch.cat([theta_joint, theta_product])
    labels = torch.cat([torch.ones(half), torch.zeros(half)])
    order = torch.randperm(rows, generator=generator)
    inputs = torch.cat([x.to(torch.float64), theta], dim=-1).to(torch.float32)
    return inputs[order], labels[order].to(torch.float32)


def sample_training_data(problem, prior, data_settings: DataSettings, seed, bank=None, proposal=None):
    """Train/validation/test arrays as numpy arrays, each split from its own generator (or the bank's rows).

    Joint pairs `<split>_x`, `<split>_theta` (data.pairing "batch"), or fixed pairs
    `<split>_inputs`, `<split>_labels` ("fixed"). A bank (x, θ) gives the splits in order:
    the first data.train rows, then data.validation, then data.test. A round's `proposal`
    (rounds.PosteriorProposal) draws the train and validation θ of joint pairs; the test
    split, whose truths the analysis reads, stays the prior's.
    """
    arrays, used, dropped = {}, 0, []
    pairing = data_settings.get("pairing", "batch")
    for split in SPLITS:
        rows = check_rows(require(data_settings, split, "data"), f"data.{split}", pairing)
        if bank is not None or pairing == "batch":
            if bank is not None:
                x, theta = (torch.as_tensor(a[used : used + rows]).to(torch.float32) for a in bank)
                used += rows
            else:
                draws = proposal if proposal is not None and split != "test" else prior
                x, theta = simulate_split(problem, draws, rows, seed, split)
            x, theta = valid_simulations(x, theta, f"data.{split}", data_settings.get("invalid", "error"))
            arrays[f"{split}_x"], arrays[f"{split}_theta"] = x.numpy(), theta.numpy()
            dropped.append(rows - len(x))
        else:
            inputs, labels = sample_pairs(problem, prior, rows, runtime.seeded_generator(seed, "split", split))
            arrays[f"{split}_inputs"], arrays[f"{split}_labels"] = inputs.numpy(), labels.numpy()
    if any(dropped):
        arrays["dropped_simulations"] = np.array(dropped, dtype=np.int64)  # per split, in SPLITS' order
    return arrays


def valid_simulations(x, theta, path, policy):
    """The simulations whose x is finite; the others fail the sampling (policy "error") or are dropped ("drop")."""
    invalid, line = invalid_simulations(x, theta, path)
    if not line:
        return x, theta
    refusal = invalid_refusal(line, policy, left=len(x) - int(invalid.sum()))
    if refusal is not None:
        raise refusal
    warnings.warn(f'{line}: dropped (data.invalid = "drop")', stacklevel=2)
    return x[~invalid], theta[~invalid]


def invalid_simulations(x, theta, path, drawn=""):
    """The rows whose x is not finite, and a line naming their share and one θ among them ("" when none)."""
    invalid = ~torch.isfinite(x).all(dim=1)
    count = int(invalid.sum())
    if not count:
        return invalid, ""
    return invalid, (
        f"{path}: {count:,} of {len(x):,} simulations{drawn} ({count / len(x):.2%}) returned NaN or infinite "
        f"values, e.g. at θ = {[round(v, 6) for v in theta[invalid][0].tolist()]}"
    )


def invalid_refusal(line, policy, left, needed=2):
    """The SettingsError for the invalid simulations of `line`, or None where "drop" leaves the `needed`."""
    if policy == "error":
        return SettingsError(
            f'{line}; fix the simulator there, or set data.invalid = "drop" to train on the others '
            "(data.* still count every simulator call)"
        )
    if left < needed:  # "drop" is set already: there is nothing left to train on
        return SettingsError(
            f"{line}, leaving {left} (at least {needed} needed); fix the simulator there, or narrow "
            "the parameter box or the prior to where it works"
        )
    return None


def check_rows(rows, path, pairing="fixed"):
    """Split sizes: at least two simulations, and even for fixed pairs (half joint, half product)."""
    if integer(rows, path, 2, MAX_ROWS) % 2 and pairing == "fixed":
        raise SettingsError(f'{path}: expected a positive even number of rows for data.pairing "fixed", got {rows!r}')
    return rows


def read_bank(spec, parameters, where="data.bank"):
    """A simulation bank (x (n, d), θ (n, p)) as float64 arrays, from an .npz with arrays "x" and "theta"
    or {"x": "x.npy", "theta": "theta.npy"}; paths relative to the current directory.

    Read only from regular files, each array's header checked (real numbers, at most
    store.MAX_NUMBERS) before its data are allocated, pickles never loaded.
    """
    if isinstance(spec, str):
        x, theta = bank_arrays(spec, where, ("x", "theta"))
    elif isinstance(spec, dict) and set(spec) == {"x", "theta"} and all(isinstance(v, str) for v in spec.values()):
        x, theta = (bank_arrays(spec[name], f"{where}.{name}", None)[0] for name in ("x", "theta"))
    else:
        raise SettingsError(
            f'{where}: expected "bank.npz" (arrays "x" and "theta") or '
            f'{{"x": "x.npy", "theta": "theta.npy"}}, got {spec!r}'
        )
    # Non-finite x are the simulator's invalid simulations, for data.invalid to decide; θ must be finite.
    if x.ndim != 2 or x.shape[1] == 0 or theta.shape != (x.shape[0], parameters) or not np.isfinite(theta).all():
        raise SettingsError(
            f"{where}: x {x.shape} and theta {theta.shape} must be real numbers (θ finite) of shapes "
            f"(n, d) and (n, {parameters}), d ≥ 1, one simulation per row"
        )
    for name, array in (("x", x), ("theta", theta)):
        if (np.abs(array[np.isfinite(array)]) > FLOAT32_MAX).any():
            raise SettingsError(
                f"{where}: its {name} holds finite values beyond float32's range "
                f"(±{FLOAT32_MAX:.3g}), which the network would read as infinite; rescale them"
            )
    return x.astype(np.float64), theta.astype(np.float64)


def bank_arrays(path, where, members):
    """The arrays `members` of the .npz at `path` (members None: the one array of an .npy), or a SettingsError.

    The file's type is checked before it is opened (a FIFO would block for ever, /dev/zero never end).
    """
    problem = irregular_file(path)
    if problem is not None:
        raise SettingsError(f"{where}: {path} {problem}; name a bank file saved with numpy.savez")
    try:
        with open(path, "rb") as stream:
            single = stream.read(len(NPY_MAGIC)) == NPY_MAGIC
            if single != (members is None):
                raise ValueError(
                    "one array of a .npy file, not an .npz archive of x and theta"
                    if single
                    else "not a .npy file of one array"
                )
            stream.seek(0)
            if members is None:
                return [read_npy(stream)]
            with zipfile.ZipFile(stream) as archive:
                return [npz_member(archive, name) for name in members]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise SettingsError(
            f"{where}: cannot read {path} as a bank ({error}); save one with numpy.savez(path, x=x, "
            'theta=theta), or name {"x": "x.npy", "theta": "theta.npy"}'
        ) from None


def npz_member(archive, name):
    """The array `name` of an open .npz archive, read through store.read_npy (header checked first)."""
    if f"{name}.npy" not in archive.namelist():
        found = ", ".join(n.removesuffix(".npy") for n in archive.namelist()) or "none"
        raise ValueError(f"it has no array {name!r} (arrays: {found})")
    with archive.open(f"{name}.npy") as stream:
        return read_npy(stream)


def bank_digest(bank):
    """The content hash of a bank: its recipe key, so a moved or renamed bank file keeps its models."""
    digest = hashlib.sha256()
    for array in bank:
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def with_kit_defaults(settings):
    """A copy of training settings with the kit's defaults where they leave a setting out: `cohort` KIT_COHORT
    (`replicas` 1), `priors` KIT_PRIORS and `data.test` as large as `data.validation`.

    Filled in, they enter the data and model keys as if written out; wrong types are left for the checks.
    """
    filled = dict(settings)
    cohort = filled.get("cohort", {})
    if isinstance(cohort, dict):
        filled["cohort"] = {**KIT_COHORT, **cohort}
    filled.setdefault("priors", KIT_PRIORS)
    data = filled.get("data")
    if isinstance(data, dict) and "validation" in data:
        filled["data"] = {**data, "test": data.get("test", data["validation"])}
    return filled


def check_cohort(settings, prior_objects):
    """`cohort` (priors and replicas), every named prior defined, and the `data` split sizes."""
    cohort = require(settings, "cohort", "settings")
    known_keys(cohort, ("priors", "replicas"), "cohort")
    names = name_list(require(cohort, "priors", "cohort"), "cohort.priors", allow_empty=False)
    integer(require(cohort, "replicas", "cohort"), "cohort.replicas", 1, 1000)
    defined = require(settings, "priors", "settings")
    if not isinstance(defined, dict):
        raise SettingsError("priors: expected a dict of prior name -> definition such as {'family': 'uniform'}")
    for i, name in enumerate(names):
        if name not in defined and name not in prior_objects:
            known = sorted(map(str, defined)) + sorted(prior_objects)
            raise SettingsError(
                f"cohort.priors[{i}]: {name!r} is not defined in priors (defined: {', '.join(known) or 'none'})"
            )
    data = require(settings, "data", "settings")
    known_keys(data, DATA_KEYS, "data")
    pairing = data.get("pairing", "batch")
    if not isinstance(pairing, str) or pairing not in PAIRINGS:
        raise SettingsError(
            f'data.pairing: {pairing!r} is not valid; use "batch" (every simulation a joint pair, '
            're-paired in every batch) or "fixed" (half joint, half product pairs, as before)'
        )
    for split in SPLITS:
        check_rows(require(data, split, "data"), f"data.{split}", pairing)
    one_of(data.get("invalid", "error"), INVALID, "data.invalid")
    if data.get("bank") is not None and pairing == "fixed":
        raise SettingsError('data.bank: a bank holds joint simulations; use it with data.pairing "batch"')


def check_contrastive(training, data: DataSettings):
    """The contrastive objective's needs: joint simulations, and batches with `classes` other rows for atoms."""
    if data.get("pairing", "batch") == "fixed":
        raise SettingsError(
            'training.objective "contrastive" re-pairs joint simulations: it needs data.pairing "batch"'
        )
    # Each row's `classes` atoms are other rows of its batch: fewer than classes + 1 rows repeat them.
    batch, path = min((training["batch_size"], "training.batch_size"), (data["train"], "data.train"))
    if batch < training["classes"] + 1:
        raise SettingsError(
            f"{path}: {batch} rows per batch, fewer than training.classes + 1 = "
            f"{training['classes'] + 1} (each row's atoms are other rows of its batch); raise "
            f"{path} or lower training.classes"
        )


def member_round(member: Member) -> tuple[object, ...]:
    """The labels a later round adds to its member's random streams: its data are fresh draws."""
    return ("round", member["round"]) if "round" in member else ()


class Study(Experiment):
    """The training side of a ratio-estimator study, derived from its science (see the module's docstring)."""

    parameters: dict[str, Any] | None = (
        None  # name -> (low, high), (low, high, lattice step) or a dict of priors.PARAMETER_KEYS
    )
    custom_priors: dict[str, Any] = {}  # a study's own prior objects by name, beside the bundled families in settings
    standardize = True  # model.standardize when the settings leave it out
    log_likelihood: Any = None  # define log_likelihood(self, x, theta) for the exact target
    SECTIONS: tuple[str, ...] = ("data",)
    OPTIONAL_SECTIONS: tuple[str, ...] = ("cohort", "priors", "problem", "model", "training", "rounds")
    DATA_SOURCES: tuple[object, ...] = (priors, sample_training_data, sample_joint, runtime.derived_seed)
    MODEL_SOURCES: tuple[object, ...] = (networks, trainer, contrast, runtime.derived_seed)

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = with_kit_defaults(settings)
        self._problem: Any = None  # make_problem's, built once
        self._bank: tuple[np.ndarray, np.ndarray] | None = None
        self.round_data: dict[str, dict[str, np.ndarray]] = {}  # a round's simulations, for the next (rounds.py)
        self.round_states: dict[str, dict[str, torch.Tensor] | None] = {}  # a round's weights, for a warm next one

    @property
    def data_settings(self) -> DataSettings:
        """The `data` section, typed (validate() checked it)."""
        return cast(DataSettings, self.settings["data"])

    @property
    def SCIENCE_SOURCES(self) -> tuple[object, ...]:
        """The study's own module: its simulator and likelihood shape the analysis' products too."""
        return (sys.modules[type(self).__module__],)

    def simulate(self, theta: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One observation (n, d) per parameter row theta (n, p), drawn from `generator`."""
        raise NotImplementedError(f"{type(self).__name__} must define simulate(theta, generator)")

    def validate(self) -> None:
        """Check the problem, the cohort and its priors, the data sizes and bank, the model and training."""
        check_cohort(self.settings, self.custom_priors)
        self.problem()
        self.check_rounds()
        for member in self.members()[: len(self.settings["cohort"]["priors"])]:
            prior = self.prior(member)
            if isinstance(prior, priors.CustomPrior):
                check_custom_prior(prior, member["prior"], type(self.custom_priors[member["prior"]]).__name__)
        bank = self.bank()
        if bank is not None:
            data = self.data_settings
            rows = data["train"] + data["validation"] + data["test"]
            if rows > len(bank[0]):
                raise SettingsError(
                    f"data.bank: holds {len(bank[0])} simulations; data.train + validation + test ask for {rows}"
                )
            share, line = self.bank_outside(bank[1])
            if share > BANK_OUTSIDE_LIMIT:
                raise SettingsError(
                    line + "; widen `parameters` to the bank's θ, or give the bank's rows inside the box"
                )
        self.check_invalid()
        networks.check_model_settings(self.model_settings())
        self.embedding_recipe()
        training = trainer.check_training_settings(self.training_settings())
        if training["objective"] == "contrastive":
            check_contrastive(training, self.data_settings)

    def check_invalid(self) -> None:
        """At plan, before anything is written, refuse what the sampling would (valid_simulations): each split
        of a bank, or CHECK_ROWS draws from each member's prior, where "drop" must leave some and "error" none.

        The draws are a sample: under "drop" they refuse a simulator only when every one failed.
        """
        policy, bank, simulate = self.data_settings.get("invalid", "error"), self.bank(), self.problem().simulate
        if bank is not None:
            used = 0
            for split in SPLITS:
                rows = self.settings["data"][split]
                x, theta = (torch.as_tensor(a[used : used + rows]) for a in bank)
                invalid, line = invalid_simulations(x, theta, f"data.{split}")
                refusal = invalid_refusal(line, policy, left=rows - int(invalid.sum())) if line else None
                if refusal is not None:
                    raise refusal
                used += rows
        elif self.data_settings.get("pairing", "batch") == "batch" and simulate is not None:
            for member in self.members()[: len(self.settings["cohort"]["priors"])]:
                theta = self.prior(member).sample(CHECK_ROWS, torch.Generator().manual_seed(0))
                x = simulate(theta, torch.Generator().manual_seed(0))
                drawn = f" that plan drew from prior {member['prior']!r}"
                invalid, line = invalid_simulations(x, theta, "data.invalid", drawn)
                if line and (policy == "error" or bool(invalid.all())):
                    raise invalid_refusal(line, policy, left=0)

    def check_rounds(self) -> None:
        """The `rounds` section and its observation, which must fit the simulator (docs/rounds.md)."""
        section = rounds.rounds_settings(self.settings)
        if section is not None:
            if self.settings["data"].get("bank") is not None:
                raise SettingsError(
                    "rounds: a bank's simulations come from the whole prior, not a round's box; "
                    'remove data.bank or the rounds section (docs/rounds.md, "Settings")'
                )
            rounds.read_observation(section["observation"], self.problem().dimension)

    def next_round(self, member: Member, tools: Any) -> Member | None:
        """The member of the round after `member` (trained first through `tools`), or None: the framework
        trains a job's rounds in turn and records the last (rounds.py, docs/rounds.md)."""
        return rounds.next_round(self, member, tools)

    def model_settings(self) -> dict[str, Any]:
        """The `model` section, or the kit's network (KIT_MODEL) when the settings have none."""
        return self.settings.get("model", KIT_MODEL)

    def training_settings(self) -> dict[str, Any]:
        """The kit's recipe (KIT_TRAINING) with the keys of the `training` section in its place."""
        training = self.settings.get("training", {})
        if not isinstance(training, dict):
            raise SettingsError(f"training: expected a dict of training settings, got {type(training).__name__}")
        return {**KIT_TRAINING, **training}

    def bank(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The simulation bank named by data.bank, read once (None without one)."""
        spec = self.data_settings.get("bank")
        if spec is not None and self._bank is None:
            self._bank = read_bank(spec, len(self.parameters or ()))
        return self._bank

    def bank_outside(self, bank_theta: np.ndarray) -> tuple[float, str]:
        """The share of the bank's θ outside the parameter box, and a line naming it (0.0, "" inside)."""
        problem, theta = self.problem(), torch.as_tensor(bank_theta)
        outside = ~((theta >= problem.low) & (theta <= problem.high)).all(dim=1)
        share = float(outside.double().mean())
        if not share:
            return 0.0, ""
        return share, (
            f"data.bank: {share:.1%} of its θ rows lie outside the parameter box (e.g. θ = "
            f"{[round(v, 4) for v in theta[outside][0].tolist()]}), where no posterior is computed"
        )

    def members(self) -> list[Member]:
        """The cohort: every prior in `cohort.priors` times `cohort.replicas`."""
        cohort = self.settings["cohort"]
        return [
            {"name": f"{prior}-r{replica}", "prior": prior, "replica": replica}
            for replica in range(cohort["replicas"])
            for prior in cohort["priors"]
        ]

    def make_problem(self) -> Any:
        """The problem from the declared parameters, simulate and log_likelihood."""
        simulates = type(self).simulate is not Study.simulate
        bank = self.bank()
        if not simulates and bank is None:
            raise SettingsError(
                f"{type(self).__name__} must define simulate(theta, generator), or train on "
                "simulations it already has (data.bank)"
            )
        return Problem(
            self.parameters,
            self.simulate if simulates else None,
            self.log_likelihood,
            type(self).__name__,
            None if bank is None else bank[0].shape[1],
        )

    def problem(self, member: Member | None = None) -> ProblemContract:
        """The simulator and its parameters, built once; a later round's member sees them inside its box."""
        if self._problem is None:
            self._problem = self.make_problem()
        if member is not None and "box" in member:
            return rounds.BoxProblem(self._problem, member["box"])
        return self._problem

    def problem_recipe(self) -> Json:
        """What the problem depends on besides the study's source: its `problem` settings."""
        return self.settings.get("problem")

    def prior(self, member: Member) -> PriorContract:
        """The member's training prior: a bundled family from `priors`, or the study's own object."""
        name = member["prior"]
        if "box" in member:  # a later round's: the member's prior cut to the round's box
            return rounds.cut_prior(self, member)
        if name in self.custom_priors and name not in self.settings["priors"]:
            return priors.CustomPrior(self.custom_priors[name], self.problem().names)
        return priors.make_prior(self.problem(), self.settings["priors"][name], f"priors.{name}")

    def prior_recipe(self, member: Member) -> Json:
        """What the member's prior depends on: its settings, or the object's description."""
        name = member["prior"]
        if "box" in member:  # a later round's: its member's prior, cut
            return {"cut": self.prior_recipe(rounds.base_member(member)), "box": member["box"]}
        if name in self.custom_priors and name not in self.settings["priors"]:
            return {"object": self.prior(member).describe()}
        return self.settings["priors"][name]

    def input_size(self) -> int:
        """Network input width: observation plus parameters."""
        problem = self.problem()
        return problem.dimension + problem.parameter_count

    def file_digests(self) -> dict[str, str]:
        """The bank's content digest, as in the data's key: a bank overwritten at its path is another training."""
        return {} if self.bank() is None else {"data.bank": bank_digest(self.bank())}

    def data_recipe(self, member: Member) -> Json:
        """The settings the member's training data depends on (a bank by its content, not its path)."""
        data = dict(self.settings["data"])
        if self.bank() is not None:
            data["bank"] = {"sha256": bank_digest(self.bank())}
        return {
            "problem": self.problem_recipe(),
            "prior": self.prior_recipe(member),
            "data": data,
            "seed": self.settings["seed"],
            "member": member["name"],
            **rounds.round_recipe(member),
        }

    def sample_data(self, member: Member) -> dict[str, np.ndarray]:
        """Train/validation/test simulations under the member's prior (or the bank's, or a round's proposal), see
        sample_training_data."""
        seed = runtime.derived_seed(self.settings["seed"], "data", member["name"], *member_round(member))
        prior = self.prior(member)
        arrays = sample_training_data(
            self.problem(), prior, self.data_settings, seed, self.bank(), rounds.proposal(prior, member)
        )
        return rounds.with_earlier(self, member, arrays)

    def model_recipe(self, member: Member) -> Json:
        """The settings the member's model depends on (besides its data key and the backend)."""
        recipe = {
            "model": self.model_settings(),
            "training": self.training_settings(),
            "seed": self.settings["seed"],
            "member": member["name"],
            "input_size": self.input_size(),
            **rounds.round_recipe(member),
        }
        embedding = self.embedding_recipe()
        if embedding is not None:  # only then: the model keys of studies without one stay as they were
            recipe["embedding"] = embedding
        return recipe

    def embedding(self) -> torch.nn.Module | None:
        """The study's network from standardised x (n, d) to features (n, k) before the classifier; None: none.

        Override it to return a fresh torch.nn.Module (docs/extending.md, "Your own network").
        """
        return None

    def embedding_recipe(self) -> Json:
        """What the model key records of the embedding: its repr and feature width (None without one)."""
        with torch.random.fork_rng(devices=[]):  # building it must not move torch's global stream
            embedding = self.embedding()
        if embedding is None:
            return None
        where = f"{type(self).__name__}.embedding()"
        return {
            "network": repr(embedding),
            "features": networks.embedding_features(embedding, self.problem().dimension, where),
        }

    def build_model(self, member: Member) -> torch.nn.Module:
        """A freshly initialised network (the embedding, then the classifier), identical for a given seed and member."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(runtime.derived_seed(self.settings["seed"], "init", member["name"]))
            return networks.build_network(
                self.model_settings(), self.input_size(), self.standardize, self.embedding(), self.problem().dimension
            )

    def train(
        self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime, hooks: Any = None
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Fit the input standardisation (or start from the previous round's weights), then train with the
        bundled trainer; returns (state dict, history)."""
        tensors = trainer.training_tensors(data)  # read once, for the fit and the training
        if "train_x" in tensors:
            inputs = torch.cat([tensors["train_x"], tensors["train_theta"]], dim=1)
        else:
            inputs = tensors["train_inputs"]
        networks.fit_standardization(model, inputs)
        rounds.warm_start(self, member, model)
        return super().train(member, model, tensors, rt, hooks)

    def workload(self, member: Member) -> dict[str, int]:
        """Training examples seen and network size: the training cost estimate (at most `epochs` epochs, in
        every round)."""
        epochs = trainer.check_training_settings(self.training_settings())["epochs"]
        count = (rounds.rounds_settings(self.settings) or {"count": 1})["count"]
        return {**super().workload(member), "training_examples": self.data_settings["train"] * epochs * count}

    def posterior(
        self,
        member: Member,
        model: torch.nn.Module,
        analysis_settings: dict[str, Any],
        observations: Any,
        truth: Any = None,
        device: str | torch.device = "cpu",
        case: int = 0,
    ) -> Any:
        """The member's posterior for an observation, from its trained `model` (see posterior.py)."""
        learned = posterior.Learned(
            self.problem(member), self.prior(member), model, analysis_settings, self.settings["seed"]
        )
        found = posterior.for_observation(learned, observations, truth=truth, device=device, case=case)
        outside = rounds.outside_warning(member, observations)
        if outside:  # a posterior warning: infer prints it as a line of its own
            found.warnings.append(outside)
            warnings.warn(outside, posterior.PosteriorWarning, stacklevel=2)
        return found

    def plan_warnings(self) -> list[str]:
        """Lines for plan: a bank's θ or priors' mass outside the parameter box, models of the earlier data
        meaning, a build_model of the study's own that drops the input standardisation."""
        bank = self.bank()
        share, line = (0.0, "") if bank is None else self.bank_outside(bank[1])
        fix = (
            "; widen `parameters` until it holds them "
            '(docs/training.md, "What `data` counts: simulations, each a joint pair used twice")'
        )
        outside = [line + fix] * (share > BOX_MASS_WARNING)
        return outside + self.box_warnings() + self.pairing_warnings() + self.network_warnings()

    def network_warnings(self) -> list[str]:
        """One line when the study's own build_model returns a network the kit cannot standardise.

        Study.train fits the standardisation only of a networks.Standardized; any other network
        would see raw x and θ while `model.standardize` says otherwise (docs/extending.md).
        """
        if type(self).build_model is Study.build_model or not self.model_settings().get(
            "standardize", self.standardize
        ):
            return []
        with torch.random.fork_rng(devices=[]):  # an override may seed torch's global stream
            model = self.build_model(self.members()[0])
        if isinstance(model, networks.Standardized):
            return []
        return [
            f"{type(self).__name__}.build_model returns a network without input standardisation (not a "
            "networks.Standardized), so it sees raw x and θ, and the `model` section shapes it only if it "
            "reads it; define embedding() instead to keep both, or set standardize = False on the class to "
            'say so (docs/extending.md, "Your own network")'
        ]

    def box_warnings(self) -> list[str]:
        """One line per prior whose draws leave the parameter box more than BOX_MASS_WARNING of the time.

        Training pairs drawn there teach the network outside the region every posterior is
        computed on, which is cut at the box's edge (docs/extending.md, "Choosing the box for an unbounded prior").
        """
        problem, found = self.problem(), []
        for member in self.members()[: len(self.settings["cohort"]["priors"])]:
            theta = self.prior(member).sample(BOX_DRAWS, runtime.seeded_generator(self.settings["seed"], "box check"))
            outside = ~((theta >= problem.low) & (theta <= problem.high)).all(dim=1)
            share = float(outside.double().mean())
            if share > BOX_MASS_WARNING:
                found.append(
                    f"prior {member['prior']!r}: {share:.1%} of its draws fall outside the parameter box "
                    f"(e.g. θ = {[round(v, 4) for v in theta[outside][0].tolist()]}); widen `parameters` "
                    "until it holds nearly all the prior's mass "
                    '(docs/extending.md, "Choosing the box for an unbounded prior")'
                )
        return found

    def pairing_warnings(self) -> list[str]:
        """One line when the output root holds models of the earlier data meaning that these settings retrain."""
        if "pairing" in self.settings["data"]:
            return []
        root = Path(self.settings["output"]["root"])
        earlier = [
            run
            for run in sorted(root.glob("runs/*/*/artifacts.json"))
            if run.is_file()
            and (root / str(output_root.read_json(run, {}).get("training-data")) / "train_labels.npy").is_file()
        ]
        if not earlier:
            return []
        return [
            f"{len(earlier)} model(s) in {root} were trained when data.train counted fixed pairs, half joint and "
            "half product; it now counts simulations, each a joint pair re-paired in every batch, so they are "
            'retrained: set data.pairing = "fixed" to keep them (docs/training.md)'
        ]

    def describe(self, member: Member) -> Json:
        """A JSON description of the member's problem and prior for run.json."""
        return {"problem": self.problem().describe(), "prior": self.prior(member).describe()}
