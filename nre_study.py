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
False; a study's own embedding network for x in front of it, `Study.embedding`), training through the bundled trainer with a measured default recipe
(`KIT_MODEL`, `KIT_TRAINING`; docs/training.md), and the whole analysis (nre_analysis.py).
docs/extending.md walks through a complete example.

Training settings sections: `cohort`, `priors`, `data`, and optionally `model` (the whole
network; without it `KIT_MODEL`), `training` (the keys it names replace `KIT_TRAINING`'s)
and a `problem` of the study's own (`self.settings["problem"]`, part of every key).
"""
import hashlib
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import contrast
import networks
import posterior
import priors
import output_root
import rounds
import runtime
import trainer
from settings import SettingsError, integer, known_keys, name_list, number, one_of, require
import study
from study import Experiment, Json, Member, PriorContract, ProblemContract

__all__ = [
    "SPLITS", "SIMULATION_CHUNK", "KIT_MODEL", "KIT_TRAINING", "Problem", "sample_joint", "sample_pairs",
    "sample_training_data", "Study",
]

SPLITS = ("train", "validation", "test")
SIMULATION_CHUNK = 4096     # simulations per simulator call: progress between calls, and bounded memory
MAX_ROWS = 10**9
# "batch": data.* count simulations, each a joint pair re-paired in every batch (contrast.py);
# "fixed": the earlier meaning, half joint and half product pairs, each a simulation, fixed for every epoch.
PAIRINGS = ("batch", "fixed")
BOX_DRAWS = 20_000          # prior draws plan checks against the parameter box
BOX_MASS_WARNING = 0.001    # the share outside the box above which plan warns
DATA_KEYS = SPLITS + ("pairing", "bank", "invalid")
# data.invalid: what a simulation with a NaN or infinite number does, "error" (the sampling
# fails, naming the share and a θ) or "drop" (the others are kept; data.* still count calls).
INVALID = ("error", "drop")
# The network and training a study gets when it writes no `model` / `training` section: chosen
# on the posterior-quality benchmark (bench/bench_posterior_quality.py; docs/training.md).
KIT_MODEL = {"kind": "residual", "width": 50, "blocks": 2, "activation": "relu"}
KIT_TRAINING = {"objective": "contrastive", "classes": 10, "gamma": 1.0, "selection": "objective",
                "batch_size": 200, "learning_rate": 5e-4, "epochs": 500, "patience": 20}


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
            raise SettingsError(f"{where}.parameters: declare the parameters as {{name: (low, high)}} "
                                "or {name: (low, high, lattice step)}")
        self._parameters = {name: parameter_values(name, value, where) for name, value in parameters.items()}
        self.names = list(self._parameters)
        self.parameter_count = len(self.names)
        self.low = torch.tensor([v["low"] for v in self._parameters.values()], dtype=torch.float64)
        self.high = torch.tensor([v["high"] for v in self._parameters.values()], dtype=torch.float64)
        steps = [v["grid_step"] for v in self._parameters.values()]
        self.grid_step = None if None in steps else torch.tensor(steps, dtype=torch.float64)
        self.simulate = simulate
        self.log_likelihood = log_likelihood
        found = None if simulate is None else observation_dimension(simulate, (self.low + self.high) / 2, where)
        if None not in (found, dimension) and found != dimension:
            raise SettingsError(f"data.bank: its x has {dimension} numbers per row where {where}.simulate returns "
                                f"{found}")
        self.dimension = found or dimension

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
    low = number(require(value, "low", path), f"{path}.low")
    high = number(require(value, "high", path), f"{path}.high")
    if not high > low:
        raise SettingsError(f"{path}: high ({high:g}) must be above low ({low:g})")
    width = high - low
    values = {"low": low, "high": high, "normal_mean": (low + high) / 2, "normal_std": width / 4,
              "exponential_rate": 1 / width, "grid_step": None, **value}
    if values["grid_step"] is not None and not 0 < number(values["grid_step"], f"{path}.grid_step") <= width:
        raise SettingsError(f"{path}.grid_step: a lattice step in (0, {width:g}] (the box's width)")
    return values


def observation_dimension(simulate, theta, where):
    """The width d of one observation, from simulating two rows twice with one seed.

    A wrong shape names the study; so does a simulator whose draws do not follow its
    generator (it draws from torch's or numpy's global stream), which would silently break
    every cached and resumed result (docs/extending.md shows the seeding wrapper).
    """
    rows = theta.expand(2, -1).clone()
    x = simulate(rows, torch.Generator().manual_seed(0))
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SettingsError(f"{where}.simulate: for 2 parameter rows it returned {shape}; it must return a "
                            "tensor (2, d), one observation of d numbers per row")
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.rand(1)                               # move the global streams: a simulator reading them differs
        np.random.random_sample()
        again = simulate(rows.clone(), torch.Generator().manual_seed(0))
    np.random.set_state(numpy_state)
    same = isinstance(again, torch.Tensor) and again.shape == x.shape
    if not (same and bool(((again == x) | (again.isnan() & x.isnan())).all())):
        raise SettingsError(f"{where}.simulate: two calls with generators of the same seed gave different "
                            "observations; draw every random number from the `generator` argument (for a simulator "
                            "on torch's or numpy's global stream, see docs/extending.md)")
    return int(x.shape[1])


def sample_joint(problem, prior, rows, generator):
    """`rows` simulations: θ from the prior, x simulated at it; float32 (x, θ) as the trainer reads them."""
    theta = prior.sample(rows, generator)
    x = problem.simulate(theta, generator)
    return x.to(torch.float32), theta.to(torch.float32)


def simulate_split(problem, prior, rows, seed, split):
    """A split's joint simulations, SIMULATION_CHUNK rows per simulator call, each chunk from its own
    stream (the first from the split's), with progress reported between calls."""
    parts = []
    study.report_progress(f"data.{split}", 0, rows)       # the clock of its rate starts here
    for chunk, start in enumerate(range(0, rows, SIMULATION_CHUNK)):
        labels = ("split", split) if chunk == 0 else ("split", split, "chunk", chunk)
        parts.append(sample_joint(problem, prior, min(SIMULATION_CHUNK, rows - start),
                                  runtime.seeded_generator(seed, *labels)))
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


def sample_training_data(problem, prior, data_settings, seed, bank=None):
    """Train/validation/test arrays as numpy arrays, each split from its own generator (or the bank's rows).

    Joint pairs `<split>_x`, `<split>_theta` (data.pairing "batch"), or fixed pairs
    `<split>_inputs`, `<split>_labels` ("fixed"). A bank (x, θ) gives the splits in order:
    the first data.train rows, then data.validation, then data.test.
    """
    arrays, used, dropped = {}, 0, []
    pairing = data_settings.get("pairing", "batch")
    for split in SPLITS:
        rows = check_rows(require(data_settings, split, "data"), f"data.{split}", pairing)
        if bank is not None or pairing == "batch":
            if bank is not None:
                x, theta = (torch.as_tensor(a[used:used + rows]).to(torch.float32) for a in bank)
                used += rows
            else:
                x, theta = simulate_split(problem, prior, rows, seed, split)
            x, theta = valid_simulations(x, theta, f"data.{split}", data_settings.get("invalid", "error"))
            arrays[f"{split}_x"], arrays[f"{split}_theta"] = x.numpy(), theta.numpy()
            dropped.append(rows - len(x))
        else:
            inputs, labels = sample_pairs(problem, prior, rows, runtime.seeded_generator(seed, "split", split))
            arrays[f"{split}_inputs"], arrays[f"{split}_labels"] = inputs.numpy(), labels.numpy()
    if any(dropped):
        arrays["dropped_simulations"] = np.array(dropped, dtype=np.int64)     # per split, in SPLITS' order
    return arrays


def valid_simulations(x, theta, path, policy):
    """The simulations whose x is finite; the others fail the sampling (policy "error") or are dropped ("drop")."""
    invalid = ~torch.isfinite(x).all(dim=1)
    count = int(invalid.sum())
    if not count:
        return x, theta
    line = (f"{path}: {count:,} of {len(x):,} simulations ({count / len(x):.2%}) returned NaN or infinite values, "
            f"e.g. at θ = {[round(v, 6) for v in theta[invalid][0].tolist()]}")
    if policy == "error" or count > len(x) - 2:
        raise ValueError(f"{line}; fix the simulator there, or set data.invalid = \"drop\" to train on the others "
                         "(data.* still count every simulator call)")
    warnings.warn(f"{line}: dropped (data.invalid = \"drop\")", stacklevel=2)
    return x[~invalid], theta[~invalid]


def check_rows(rows, path, pairing="fixed"):
    """Split sizes: at least two simulations, and even for fixed pairs (half joint, half product)."""
    if integer(rows, path, 2, MAX_ROWS) % 2 and pairing == "fixed":
        raise SettingsError(f"{path}: expected a positive even number of rows for data.pairing \"fixed\", got {rows!r}")
    return rows


def read_bank(spec, parameters, where="data.bank"):
    """A simulation bank (x (n, d), θ (n, p)) as float64 arrays, from an .npz with arrays "x" and "theta"
    or {"x": "x.npy", "theta": "theta.npy"}; paths relative to the current directory."""
    try:
        if isinstance(spec, str):
            with np.load(Path(spec), allow_pickle=False) as bank:
                x, theta = bank["x"], bank["theta"]
        elif isinstance(spec, dict) and set(spec) == {"x", "theta"}:
            x, theta = (np.load(Path(spec[name]), allow_pickle=False) for name in ("x", "theta"))
        else:
            raise SettingsError(f'{where}: expected "bank.npz" (arrays "x" and "theta") or '
                                f'{{"x": "x.npy", "theta": "theta.npy"}}, got {spec!r}')
    except (OSError, ValueError, KeyError, EOFError) as error:
        raise SettingsError(f"{where}: cannot read {spec!r} as arrays x and theta ({error})") from None
    # Non-finite x are the simulator's invalid simulations, for data.invalid to decide; θ must be finite.
    if x.ndim != 2 or theta.shape != (x.shape[0], parameters) or not all(
            np.issubdtype(a.dtype, np.number) and not np.iscomplexobj(a) for a in (x, theta)) \
            or not np.isfinite(theta).all():
        raise SettingsError(f"{where}: x {x.shape} and theta {theta.shape} must be real numbers (θ finite) of shapes "
                            f"(n, d) and (n, {parameters}), one simulation per row")
    return x.astype(np.float64), theta.astype(np.float64)


def bank_digest(bank):
    """The content hash of a bank: its recipe key, so a moved or renamed bank file keeps its models."""
    digest = hashlib.sha256()
    for array in bank:
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


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
            raise SettingsError(f"cohort.priors[{i}]: {name!r} is not defined in priors "
                                f"(defined: {', '.join(known) or 'none'})")
    data = require(settings, "data", "settings")
    known_keys(data, DATA_KEYS, "data")
    pairing = data.get("pairing", "batch")
    if not isinstance(pairing, str) or pairing not in PAIRINGS:
        raise SettingsError(f'data.pairing: {pairing!r} is not valid; use "batch" (every simulation a joint pair, '
                            're-paired in every batch) or "fixed" (half joint, half product pairs, as before)')
    for split in SPLITS:
        check_rows(require(data, split, "data"), f"data.{split}", pairing)
    one_of(data.get("invalid", "error"), INVALID, "data.invalid")
    if data.get("bank") is not None and pairing == "fixed":
        raise SettingsError('data.bank: a bank holds joint simulations; use it with data.pairing "batch"')


def member_round(member: Member) -> tuple[object, ...]:
    """The labels a later round adds to its member's random streams: its data are fresh draws."""
    return ("round", member["round"]) if "round" in member else ()


class Study(Experiment):
    """The training side of a ratio-estimator study, derived from its science (see the module's docstring)."""

    parameters: dict[str, Any] | None = None        # name -> (low, high), (low, high, lattice step) or a dict of priors.PARAMETER_KEYS
    custom_priors: dict[str, Any] = {}       # a study's own prior objects by name, beside the bundled families in settings
    standardize = True       # model.standardize when the settings leave it out
    log_likelihood: Any = None    # define log_likelihood(self, x, theta) for the exact target
    SECTIONS: tuple[str, ...] = ("cohort", "priors", "data")
    OPTIONAL_SECTIONS: tuple[str, ...] = ("problem", "model", "training", "rounds")
    DATA_SOURCES: tuple[object, ...] = (priors, sample_training_data, sample_joint, runtime.derived_seed)
    MODEL_SOURCES: tuple[object, ...] = (networks, trainer, contrast, runtime.derived_seed)

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._problem: Any = None              # make_problem's, built once
        self._bank: tuple[np.ndarray, np.ndarray] | None = None
        self.round_data: dict[str, dict[str, np.ndarray]] = {}     # a round's simulations, for the next (rounds.py)

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
        for member in self.members()[:len(self.settings["cohort"]["priors"])]:
            self.prior(member)
        bank = self.bank()
        if bank is not None:
            rows = sum(self.settings["data"][split] for split in SPLITS)
            if rows > len(bank[0]):
                raise SettingsError(f"data.bank: holds {len(bank[0])} simulations; data.train + validation + "
                                    f"test ask for {rows}")
        networks.check_model_settings(self.model_settings())
        self.embedding_recipe()
        training = trainer.check_training_settings(self.training_settings())
        if training["objective"] == "contrastive" and self.settings["data"].get("pairing", "batch") == "fixed":
            raise SettingsError('training.objective "contrastive" re-pairs joint simulations: it needs data.pairing '
                                '"batch"')

    def check_rounds(self) -> None:
        """The `rounds` section and its observation, which must fit the simulator (docs/rounds.md)."""
        section = rounds.rounds_settings(self.settings)
        if section is not None:
            if self.settings["data"].get("bank") is not None:
                raise SettingsError("rounds: a bank's simulations come from the whole prior, not a round's box; "
                                    'remove data.bank or the rounds section (docs/rounds.md, "Settings")')
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
        spec = self.settings["data"].get("bank")
        if spec is not None and self._bank is None:
            self._bank = read_bank(spec, len(self.parameters or ()))
        return self._bank

    def members(self) -> list[Member]:
        """The cohort: every prior in `cohort.priors` times `cohort.replicas`."""
        cohort = self.settings["cohort"]
        return [{"name": f"{prior}-r{replica}", "prior": prior, "replica": replica}
                for replica in range(cohort["replicas"]) for prior in cohort["priors"]]

    def make_problem(self) -> Any:
        """The problem from the declared parameters, simulate and log_likelihood."""
        simulates = type(self).simulate is not Study.simulate
        bank = self.bank()
        if not simulates and bank is None:
            raise SettingsError(f"{type(self).__name__} must define simulate(theta, generator), or train on "
                                "simulations it already has (data.bank)")
        return Problem(self.parameters, self.simulate if simulates else None, self.log_likelihood,
                       type(self).__name__, None if bank is None else bank[0].shape[1])

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
        if "box" in member:                 # a later round's: the member's prior cut to the round's box
            return rounds.cut_prior(self, member)
        if name in self.custom_priors and name not in self.settings["priors"]:
            return priors.CustomPrior(self.custom_priors[name], self.problem().names)
        return priors.make_prior(self.problem(), self.settings["priors"][name], f"priors.{name}")

    def prior_recipe(self, member: Member) -> Json:
        """What the member's prior depends on: its settings, or the object's description."""
        name = member["prior"]
        if "box" in member:                 # a later round's: its member's prior, cut
            return {"cut": self.prior_recipe(rounds.base_member(member)), "box": member["box"]}
        if name in self.custom_priors and name not in self.settings["priors"]:
            return {"object": self.prior(member).describe()}
        return self.settings["priors"][name]

    def input_size(self) -> int:
        """Network input width: observation plus parameters."""
        problem = self.problem()
        return problem.dimension + problem.parameter_count

    def data_recipe(self, member: Member) -> Json:
        """The settings the member's training data depends on (a bank by its content, not its path)."""
        data = dict(self.settings["data"])
        if self.bank() is not None:
            data["bank"] = {"sha256": bank_digest(self.bank())}
        return {"problem": self.problem_recipe(), "prior": self.prior_recipe(member), "data": data,
                "seed": self.settings["seed"], "member": member["name"], **rounds.round_recipe(member)}

    def sample_data(self, member: Member) -> dict[str, np.ndarray]:
        """Train/validation/test simulations under the member's prior (or the bank's), see sample_training_data."""
        seed = runtime.derived_seed(self.settings["seed"], "data", member["name"], *member_round(member))
        arrays = sample_training_data(self.problem(), self.prior(member), self.settings["data"], seed, self.bank())
        return rounds.with_earlier(self, member, arrays)

    def model_recipe(self, member: Member) -> Json:
        """The settings the member's model depends on (besides its data key and the backend)."""
        recipe = {"model": self.model_settings(), "training": self.training_settings(),
                  "seed": self.settings["seed"], "member": member["name"], "input_size": self.input_size(),
                  **rounds.round_recipe(member)}
        embedding = self.embedding_recipe()
        if embedding is not None:        # only then: the model keys of studies without one stay as they were
            recipe["embedding"] = embedding
        return recipe

    def embedding(self) -> torch.nn.Module | None:
        """The study's network from standardised x (n, d) to features (n, k) before the classifier; None: none.

        Override it to return a fresh torch.nn.Module (docs/extending.md, "Your own network").
        """
        return None

    def embedding_recipe(self) -> Json:
        """What the model key records of the embedding: its repr and feature width (None without one)."""
        with torch.random.fork_rng(devices=[]):          # building it must not move torch's global stream
            embedding = self.embedding()
        if embedding is None:
            return None
        where = f"{type(self).__name__}.embedding()"
        return {"network": repr(embedding),
                "features": networks.embedding_features(embedding, self.problem().dimension, where)}

    def build_model(self, member: Member) -> torch.nn.Module:
        """A freshly initialised network (the embedding, then the classifier), identical for a given seed and member."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(runtime.derived_seed(self.settings["seed"], "init", member["name"]))
            return networks.build_network(self.model_settings(), self.input_size(), self.standardize,
                                          self.embedding(), self.problem().dimension)

    def train(self, member: Member, model: torch.nn.Module, data: Any, rt: runtime.Runtime,
              hooks: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
        """Fit the input standardisation, then train with the bundled trainer; returns (state dict, history)."""
        tensors = trainer.training_tensors(data)          # read once, for the fit and the training
        if "train_x" in tensors:
            inputs = torch.cat([tensors["train_x"], tensors["train_theta"]], dim=1)
        else:
            inputs = tensors["train_inputs"]
        networks.fit_standardization(model, inputs)
        return super().train(member, model, tensors, rt, hooks)

    def workload(self, member: Member) -> dict[str, int]:
        """Training examples seen and network size: the training cost estimate (at most `epochs` epochs)."""
        epochs = trainer.check_training_settings(self.training_settings())["epochs"]
        return {**super().workload(member), "training_examples": self.settings["data"]["train"] * epochs}

    def posterior(self, member: Member, model: torch.nn.Module, analysis_settings: dict[str, Any], observations: Any,
                  truth: Any = None, device: str | torch.device = "cpu", case: int = 0) -> Any:
        """The member's posterior for an observation, from its trained `model` (see posterior.py)."""
        learned = posterior.Learned(self.problem(member), self.prior(member), model, analysis_settings,
                                    self.settings["seed"])
        outside = rounds.outside_warning(member, observations)
        if outside:
            warnings.warn(outside, stacklevel=2)
        return posterior.for_observation(learned, observations, truth=truth, device=device, case=case)

    def plan_warnings(self) -> list[str]:
        """Lines for plan: priors with mass outside the parameter box, models of the earlier data meaning,
        a build_model of the study's own that drops the input standardisation."""
        return self.box_warnings() + self.pairing_warnings() + self.network_warnings()

    def network_warnings(self) -> list[str]:
        """One line when the study's own build_model returns a network the kit cannot standardise.

        Study.train fits the standardisation only of a networks.Standardized; any other network
        would see raw x and θ while `model.standardize` says otherwise (docs/extending.md).
        """
        if type(self).build_model is Study.build_model or \
                not self.model_settings().get("standardize", self.standardize):
            return []
        with torch.random.fork_rng(devices=[]):          # an override may seed torch's global stream
            model = self.build_model(self.members()[0])
        if isinstance(model, networks.Standardized):
            return []
        return [f"{type(self).__name__}.build_model returns a network without input standardisation (not a "
                "networks.Standardized), so it sees raw x and θ, and the `model` section shapes it only if it "
                "reads it; define embedding() instead to keep both, or set standardize = False on the class to "
                'say so (docs/extending.md, "Your own network")']

    def box_warnings(self) -> list[str]:
        """One line per prior whose draws leave the parameter box more than BOX_MASS_WARNING of the time.

        Training pairs drawn there teach the network outside the region every posterior is
        computed on, which is cut at the box's edge (docs/extending.md: choosing a box).
        """
        problem, found = self.problem(), []
        for member in self.members()[:len(self.settings["cohort"]["priors"])]:
            theta = self.prior(member).sample(BOX_DRAWS, runtime.seeded_generator(self.settings["seed"], "box check"))
            outside = ~((theta >= problem.low) & (theta <= problem.high)).all(dim=1)
            share = float(outside.double().mean())
            if share > BOX_MASS_WARNING:
                found.append(f"prior {member['prior']!r}: {share:.1%} of its draws fall outside the parameter box "
                             f"(e.g. θ = {[round(v, 4) for v in theta[outside][0].tolist()]}); widen `parameters` "
                             "until it holds nearly all the prior's mass (docs/extending.md)")
        return found

    def pairing_warnings(self) -> list[str]:
        """One line when the output root holds models of the earlier data meaning that these settings retrain."""
        if "pairing" in self.settings["data"]:
            return []
        root = Path(self.settings["output"]["root"])
        earlier = [run for run in sorted(root.glob("runs/*/*/artifacts.json")) if run.is_file()
                   and (root / str(output_root.read_json(run, {}).get("training-data")) / "train_labels.npy").is_file()]
        if not earlier:
            return []
        return [f"{len(earlier)} model(s) in {root} were trained when data.train counted fixed pairs, half joint and "
                "half product; it now counts simulations, each a joint pair re-paired in every batch, so they are "
                'retrained: set data.pairing = "fixed" to keep them (docs/training.md)']

    def describe(self, member: Member) -> Json:
        """A JSON description of the member's problem and prior for run.json."""
        return {"problem": self.problem().describe(), "prior": self.prior(member).describe()}
