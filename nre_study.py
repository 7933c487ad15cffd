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
(`custom_priors = {"name": object}` on the class), balanced joint and product training pairs,
the network (networks.py, inputs standardised on the training data unless
`model.standardize` is False), training through the bundled trainer, and the whole
analysis (nre_analysis.py). docs/extending.md walks through a complete example.

Training settings sections: `cohort`, `priors`, `data`, `model`, `training`, and an
optional `problem` of the study's own (`self.settings["problem"]`, part of every key).
"""
import sys

import torch

import networks
import posterior
import priors
import runtime
import trainer
from settings import SettingsError, integer, known_keys, name_list, number, require
from study import Experiment

SPLITS = ("train", "validation", "test")
MAX_ROWS = 10**9


class Problem:
    """The parameters and simulator of a study, in the form the analysis reads.

    `names`, `low`, `high` (float64 (p,)), `grid_step` ((p,), or None unless every
    parameter has a lattice step), `dimension` (of one observation), `simulate(theta,
    generator)`, `log_likelihood(x, theta)` (None without one) and `parameter(name)`:
    the box and the bundled priors' hyper-parameters of one parameter.
    """

    def __init__(self, parameters, simulate, log_likelihood, where):
        """Check the declared parameters and find the observation's dimension by one simulation."""
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
        self.dimension = observation_dimension(simulate, (self.low + self.high) / 2, where)

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
    """The width d of one observation, from simulating two rows; a wrong shape names the study."""
    rows = theta.expand(2, -1).clone()
    x = simulate(rows, torch.Generator().manual_seed(0))
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SettingsError(f"{where}.simulate: for 2 parameter rows it returned {shape}; it must return a "
                            "tensor (2, d), one observation of d numbers per row")
    return int(x.shape[1])


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


def sample_training_data(problem, prior, data_settings, seed):
    """Train/validation/test pairs as numpy arrays, each split from its own generator."""
    arrays = {}
    for split in SPLITS:
        rows = check_rows(require(data_settings, split, "data"), f"data.{split}")
        generator = runtime.seeded_generator(seed, "split", split)
        inputs, labels = sample_pairs(problem, prior, rows, generator)
        arrays[f"{split}_inputs"] = inputs.numpy()
        arrays[f"{split}_labels"] = labels.numpy()
    return arrays


def check_rows(rows, path):
    """Split sizes are positive even integers (half joint, half product pairs)."""
    if integer(rows, path, 2, MAX_ROWS) % 2:
        raise SettingsError(f"{path}: expected a positive even number of rows, got {rows!r}")
    return rows


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
    known_keys(data, SPLITS, "data")
    for split in SPLITS:
        check_rows(require(data, split, "data"), f"data.{split}")


class Study(Experiment):
    """The training side of a ratio-estimator study, derived from its science (see the module's docstring)."""

    parameters = None        # name -> (low, high), (low, high, lattice step) or a dict of priors.PARAMETER_KEYS
    custom_priors = {}       # a study's own prior objects by name, beside the bundled families in settings
    standardize = True       # model.standardize when the settings leave it out
    log_likelihood = None    # define log_likelihood(self, x, theta) for the exact target
    SECTIONS = ("cohort", "priors", "data", "model", "training")
    OPTIONAL_SECTIONS = ("problem",)
    DATA_SOURCES = (priors, sample_training_data, runtime.derived_seed)
    MODEL_SOURCES = (networks, trainer, runtime.derived_seed)

    def __init__(self, settings):
        self.settings = settings
        self._problem = None

    @property
    def SCIENCE_SOURCES(self):
        """The study's own module: its simulator and likelihood shape the analysis' products too."""
        return (sys.modules[type(self).__module__],)

    def simulate(self, theta, generator):
        """One observation (n, d) per parameter row theta (n, p), drawn from `generator`."""
        raise NotImplementedError(f"{type(self).__name__} must define simulate(theta, generator)")

    def validate(self):
        """Check the problem, the cohort and its priors, the data sizes and the model."""
        self.problem()
        check_cohort(self.settings, self.custom_priors)
        for member in self.members()[:len(self.settings["cohort"]["priors"])]:
            self.prior(member)
        networks.check_model_settings(self.settings["model"])

    def members(self):
        """The cohort: every prior in `cohort.priors` times `cohort.replicas`."""
        cohort = self.settings["cohort"]
        return [{"name": f"{prior}-r{replica}", "prior": prior, "replica": replica}
                for replica in range(cohort["replicas"]) for prior in cohort["priors"]]

    def make_problem(self):
        """The problem from the declared parameters, simulate and log_likelihood."""
        return Problem(self.parameters, self.simulate, self.log_likelihood, type(self).__name__)

    def problem(self, member=None):
        """The simulator and its parameters (the same for every member), built once."""
        if self._problem is None:
            self._problem = self.make_problem()
        return self._problem

    def problem_recipe(self):
        """What the problem depends on besides the study's source: its `problem` settings."""
        return self.settings.get("problem")

    def prior(self, member):
        """The member's training prior: a bundled family from `priors`, or the study's own object."""
        name = member["prior"]
        if name in self.custom_priors and name not in self.settings["priors"]:
            return priors.CustomPrior(self.custom_priors[name], self.problem().names)
        return priors.make_prior(self.problem(), self.settings["priors"][name], f"priors.{name}")

    def prior_recipe(self, member):
        """What the member's prior depends on: its settings, or the object's description."""
        name = member["prior"]
        if name in self.custom_priors and name not in self.settings["priors"]:
            return {"object": self.prior(member).describe()}
        return self.settings["priors"][name]

    def input_size(self):
        """Network input width: observation plus parameters."""
        problem = self.problem()
        return problem.dimension + problem.parameter_count

    def data_recipe(self, member):
        """The settings the member's training data depends on."""
        return {"problem": self.problem_recipe(), "prior": self.prior_recipe(member), "data": self.settings["data"],
                "seed": self.settings["seed"], "member": member["name"]}

    def sample_data(self, member):
        """Balanced train/validation/test pairs under the member's prior."""
        seed = runtime.derived_seed(self.settings["seed"], "data", member["name"])
        return sample_training_data(self.problem(), self.prior(member), self.settings["data"], seed)

    def model_recipe(self, member):
        """The settings the member's model depends on (besides its data key and the backend)."""
        return {"model": self.settings["model"], "training": self.settings["training"],
                "seed": self.settings["seed"], "member": member["name"], "input_size": self.input_size()}

    def build_model(self, member):
        """A freshly initialised network, identical for a given seed and member."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(runtime.derived_seed(self.settings["seed"], "init", member["name"]))
            return networks.build_network(self.settings["model"], self.input_size(), self.standardize)

    def train(self, member, model, data, rt, hooks=None):
        """Fit the input standardisation, then train with the bundled trainer; returns (state dict, history)."""
        tensors = trainer.training_tensors(data)          # read once, for the fit and the training
        networks.fit_standardization(model, tensors["train_inputs"])
        return super().train(member, model, tensors, rt, hooks)

    def workload(self, member):
        """Training examples seen and network size: the training cost estimate."""
        epochs = trainer.check_training_settings(self.settings["training"])["epochs"]
        return {**super().workload(member), "training_examples": self.settings["data"]["train"] * epochs}

    def posterior(self, member, model, analysis_settings, observations, truth=None, device="cpu", case=0):
        """The member's posterior for an observation, from its trained `model` (see posterior.py)."""
        return posterior.for_observation(self.problem(), self.prior(member), model, analysis_settings, observations,
                                         self.settings["seed"], truth=truth, device=device, case=case)

    def describe(self, member):
        """A JSON description of the member's problem and prior for run.json."""
        return {"problem": self.problem().describe(), "prior": self.prior(member).describe()}
