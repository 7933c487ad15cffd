"""A second study for nnpd: the decay rate of a radioactive source, from waiting times.

A source decays at an unknown rate λ (per second). An observation is the `waiting_times`
intervals between successive decays, independent and exponential with rate λ. The
parameter learned is θ = log λ, inside [log rate_low, log rate_high]. Two priors are
offered: "log-uniform" (uniform in θ) and "uniform" (uniform in λ, so its density in θ
grows as e^θ).

The likelihood is exact, log p(x | θ) = n θ − e^θ Σ x, so the analysis compares every
learned posterior (prior × learned ratio, on a grid of θ) with the exact one: coverage of
highest-density intervals and how far the two posteriors are apart.

docs/extending.md walks through this file; the settings are in this folder, and
    PYTHONPATH=examples/decay python nnpd.py run --settings-dir examples/decay
trains and analyses the "quick" profile on a CPU in seconds.
"""
import math

import numpy as np
import torch

import inference
import runtime
import trainer
from settings import SettingsError, integer, known_keys, name_list, number, one_of, require
from study import Figure, Metric, Product

PRIOR_FAMILIES = ("log-uniform", "uniform")
SPLITS = ("train", "validation", "test")


# ---------------------------------------------------------------- the simulator and the priors

def theta_bounds(problem):
    """The parameter range [log rate_low, log rate_high]."""
    return math.log(problem["rate_low"]), math.log(problem["rate_high"])


def sample_theta(problem, family, rows, generator):
    """θ = log λ drawn from a prior family."""
    low, high = theta_bounds(problem)
    uniform = torch.rand(rows, generator=generator, dtype=torch.float64)
    if family == "log-uniform":
        return low + (high - low) * uniform
    rate_low, rate_high = problem["rate_low"], problem["rate_high"]
    return torch.log(rate_low + (rate_high - rate_low) * uniform)


def prior_log_density(problem, family, theta):
    """The prior's log density in θ (both families are normalised on the parameter range)."""
    low, high = theta_bounds(problem)
    theta = torch.as_tensor(theta, dtype=torch.float64)
    if family == "log-uniform":
        return torch.full_like(theta, -math.log(high - low))
    # λ uniform on [rate_low, rate_high]: p(θ) = e^θ / (rate_high − rate_low)
    return theta - math.log(problem["rate_high"] - problem["rate_low"])


def simulate_log_times(theta, waiting_times, generator):
    """log of `waiting_times` exponential intervals at rate e^θ, one row per θ."""
    unit = torch.empty((len(theta), waiting_times), dtype=torch.float64).exponential_(generator=generator)
    return torch.log(unit) - theta[:, None]


def exact_log_likelihood(log_times, theta):
    """log p(x | θ) = n θ − e^θ Σ x for every (case, grid point): shape (cases, points)."""
    n = log_times.shape[1]
    total = torch.exp(log_times).sum(1)
    return n * theta[None, :] - torch.exp(theta)[None, :] * total[:, None]


def sample_pairs(problem, family, rows, generator):
    """Shuffled joint (label 1) and product (label 0) pairs; inputs are [log x, θ]."""
    half = rows // 2
    theta_joint = sample_theta(problem, family, half, generator)
    x_joint = simulate_log_times(theta_joint, problem["waiting_times"], generator)
    theta_product = sample_theta(problem, family, rows - half, generator)
    x_product = simulate_log_times(sample_theta(problem, family, rows - half, generator),
                                   problem["waiting_times"], generator)
    inputs = torch.cat([torch.cat([x_joint, theta_joint[:, None]], 1),
                        torch.cat([x_product, theta_product[:, None]], 1)])
    labels = torch.cat([torch.ones(half), torch.zeros(rows - half)])
    order = torch.randperm(rows, generator=generator)
    return inputs[order].float(), labels[order]


# ---------------------------------------------------------------- settings checks

def check_problem(problem):
    """The `problem` section: the number of waiting times and the range of rates."""
    known_keys(problem, ("waiting_times", "rate_low", "rate_high"), "problem")
    integer(require(problem, "waiting_times", "problem"), "problem.waiting_times", 1, 10_000)
    low = number(require(problem, "rate_low", "problem"), "problem.rate_low", 0, 1e6, low_open=True)
    high = number(require(problem, "rate_high", "problem"), "problem.rate_high", 0, 1e6, low_open=True)
    if not high > low:
        raise SettingsError(f"problem.rate_high: {high:g} is not above problem.rate_low ({low:g}); raise it")


def check_cohort(settings):
    """`cohort`, `priors`, `data` and `model`: what the cohort is made of and how large it is."""
    cohort = settings["cohort"]
    known_keys(cohort, ("priors", "replicas"), "cohort")
    for name in name_list(require(cohort, "priors", "cohort"), "cohort.priors", allow_empty=False):
        prior = require(settings["priors"], name, "priors")
        known_keys(prior, ("family",), f"priors.{name}")
        one_of(require(prior, "family", f"priors.{name}"), PRIOR_FAMILIES, f"priors.{name}.family")
    integer(require(cohort, "replicas", "cohort"), "cohort.replicas", 1, 1000)
    known_keys(settings["data"], SPLITS, "data")
    for split in SPLITS:
        integer(require(settings["data"], split, "data"), f"data.{split}", 2, 10**8)
    known_keys(settings["model"], ("hidden",), "model")
    hidden = require(settings["model"], "hidden", "model")
    if not isinstance(hidden, list) or not hidden:
        raise SettingsError(f"model.hidden: expected a non-empty list of layer widths, got {hidden!r}")
    for index, width in enumerate(hidden):
        integer(width, f"model.hidden[{index}]", 1, 65_536)


# ---------------------------------------------------------------- the experiment

class DecayExperiment:
    """Training side: one classifier per cohort member (a prior and a replica)."""

    # Module-level code besides this class that shapes the data and the models: editing it
    # changes their keys, so nothing stale is reused.
    DATA_SOURCES = (sample_pairs, runtime.derived_seed)
    MODEL_SOURCES = (trainer, runtime.derived_seed)

    def __init__(self, settings):
        self.settings = settings

    def validate(self):
        """Check every section this experiment reads (the trainer checks `training`)."""
        check_problem(self.settings["problem"])
        check_cohort(self.settings)
        trainer.check_training_settings(self.settings["training"])

    def members(self):
        """Every prior in `cohort.priors` times `cohort.replicas`."""
        cohort = self.settings["cohort"]
        return [{"name": f"{prior}-r{replica}", "prior": prior, "replica": replica}
                for replica in range(cohort["replicas"]) for prior in cohort["priors"]]

    def problem(self, member=None):
        """The simulator's settings (the same for every member)."""
        return self.settings["problem"]

    def prior(self, member):
        """The member's prior family."""
        return self.settings["priors"][member["prior"]]["family"]

    def input_size(self):
        """Network input width: the log waiting times and θ."""
        return self.settings["problem"]["waiting_times"] + 1

    def data_recipe(self, member):
        """What the member's training data depends on."""
        return {"problem": self.settings["problem"], "prior": self.prior(member), "data": self.settings["data"],
                "seed": self.settings["seed"], "member": member["name"]}

    def sample_data(self, member):
        """Train, validation and test pairs, each split from its own random stream."""
        arrays = {}
        for split in SPLITS:
            generator = runtime.seeded_generator(self.settings["seed"], "data", member["name"], split)
            inputs, labels = sample_pairs(self.problem(), self.prior(member), self.settings["data"][split], generator)
            arrays[f"{split}_inputs"], arrays[f"{split}_labels"] = inputs.numpy(), labels.numpy()
        return arrays

    def model_recipe(self, member):
        """What the member's model depends on besides its data and the backend."""
        return {"model": self.settings["model"], "training": self.settings["training"],
                "seed": self.settings["seed"], "member": member["name"], "input_size": self.input_size()}

    def build_model(self, member):
        """A freshly initialised ReLU network returning one logit per row (same seed, same weights)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(runtime.derived_seed(self.settings["seed"], "init", member["name"]))
            layers, width = [], self.input_size()
            for hidden in self.settings["model"]["hidden"]:
                layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
                width = hidden
            return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1), torch.nn.Flatten(0))

    def train(self, member, model, data, rt, hooks=None):
        """The bundled trainer, with the framework's hooks (resume, save, stop, progress)."""
        tensors = {name: torch.from_numpy(np.asarray(data.array(name))) for name in
                   ("train_inputs", "train_labels", "validation_inputs", "validation_labels")}
        seed = runtime.derived_seed(self.settings["seed"], "train", member["name"])
        return trainer.train(model, tensors, self.settings["training"], rt, seed, hooks)

    def workload(self, member):
        """Examples seen in training and the network's size (the plan's cost estimate)."""
        parameters = sum(p.numel() for p in self.build_model(member).parameters())
        epochs = trainer.check_training_settings(self.settings["training"])["epochs"]
        return {"training_examples": self.settings["data"]["train"] * epochs, "network_parameters": parameters}

    def describe(self, member):
        """What run.json says about the member's problem."""
        low, high = self.settings["problem"]["rate_low"], self.settings["problem"]["rate_high"]
        return {"simulator": f"{self.settings['problem']['waiting_times']} exponential waiting times",
                "parameter": "theta = log(rate)", "rates": [low, high], "prior": self.prior(member)}


# ---------------------------------------------------------------- analysis: products

def theta_grid(ctx):
    """Midpoints of `inference.grid_points` equal cells over the parameter range."""
    low, high = theta_bounds(ctx.problem)
    points = ctx.analysis_settings["inference"]["grid_points"]
    return low + (high - low) * (torch.arange(points, dtype=torch.float64) + 0.5) / points


def build_cases(ctx, writer):
    """Test cases: true θ drawn from the member's prior, and one observation of each."""
    generator = ctx.generator("cases", ctx.member["prior"])
    theta = sample_theta(ctx.problem, ctx.prior, ctx.analysis_settings["inference"]["cases"], generator)
    writer.array("theta", theta.numpy())
    writer.array("log_times", simulate_log_times(theta, ctx.problem["waiting_times"], generator).numpy())
    return {"cases": len(theta)}


def build_learned(ctx, writer):
    """The trained network's log ratio on the θ grid for every case: shape (cases, grid points)."""
    log_times = torch.from_numpy(ctx.require("cases").array("log_times"))
    grid = theta_grid(ctx)
    scores = []
    with torch.no_grad():
        for chunk in log_times.split(256):                # bounded memory for many cases
            rows = torch.cat([chunk.repeat_interleave(len(grid), 0), grid.repeat(len(chunk))[:, None]], 1)
            logits = ctx.model(rows.float().to(ctx.runtime.device))
            scores.append(logits.double().cpu().reshape(len(chunk), len(grid)))
    writer.array("log_ratio", torch.cat(scores).numpy())
    return {"grid_points": len(grid)}


def build_exact(ctx, writer):
    """The exact log likelihood on the θ grid for every case: shape (cases, grid points)."""
    log_times = torch.from_numpy(ctx.require("cases").array("log_times"))
    writer.array("log_likelihood", exact_log_likelihood(log_times, theta_grid(ctx)).numpy())


def grid_posteriors(ctx):
    """(learned, exact) posterior masses on the θ grid, one row per case, each row summing to 1."""
    log_prior = prior_log_density(ctx.problem, ctx.prior, theta_grid(ctx))
    learned = torch.from_numpy(ctx.require("learned").array("log_ratio")) + log_prior
    exact = torch.from_numpy(ctx.require("exact").array("log_likelihood")) + log_prior
    return torch.softmax(learned, 1), torch.softmax(exact, 1)


# ---------------------------------------------------------------- analysis: metrics

def highest_density(masses, level):
    """Per case, the grid cells of the highest-density region holding `level` of the mass (booleans)."""
    order = torch.argsort(masses, 1, descending=True)
    sorted_masses = torch.gather(masses, 1, order)
    # A cell is inside when the mass of the cells denser than it is still short of the level.
    inside_sorted = (torch.cumsum(sorted_masses, 1) - sorted_masses) < level
    return torch.zeros_like(inside_sorted).scatter(1, order, inside_sorted)


def truth_cells(ctx, theta):
    """The grid cell holding each true θ."""
    low, high = theta_bounds(ctx.problem)
    points = ctx.analysis_settings["inference"]["grid_points"]
    return ((theta - low) / (high - low) * points).long().clamp(0, points - 1)


def metric_coverage(ctx):
    """Per level: how often the truth lies in the learned ("joint") and the exact highest-density region."""
    learned, exact = grid_posteriors(ctx)
    theta = torch.from_numpy(ctx.require("cases").array("theta"))
    cells, cases = truth_cells(ctx, theta), torch.arange(len(theta))
    report = {}
    for level in ctx.analysis_settings["inference"]["levels"]:
        entry = {"nominal": level, "cases": len(theta)}
        # "joint" and "interval" are the names `nnpd.py report` reads (as for the bundled study).
        for name, interval, masses in (("joint", "interval", learned), ("exact", "exact_interval", exact)):
            hits = highest_density(masses, level)[cases, cells]
            entry[name] = float(hits.double().mean())
            entry[interval] = inference.wilson_interval(int(hits.sum()), len(theta))
        report[inference.level_key(level)] = entry
    return report


def metric_width(ctx):
    """Per level: the mean length in θ of the learned and of the exact highest-density regions."""
    learned, exact = grid_posteriors(ctx)
    grid = theta_grid(ctx)
    cell = float(grid[1] - grid[0])
    report = {}
    for level in ctx.analysis_settings["inference"]["levels"]:
        report[inference.level_key(level)] = {
            "mean": float(highest_density(learned, level).sum(1).double().mean()) * cell,
            "exact_mean": float(highest_density(exact, level).sum(1).double().mean()) * cell}
    return report


def metric_bias(ctx):
    """Error of the posterior mean of θ against the truth: learned and exact, signed and RMSE."""
    learned, exact = grid_posteriors(ctx)
    grid, theta = theta_grid(ctx), torch.from_numpy(ctx.require("cases").array("theta"))
    report = {"cases": len(theta)}
    for prefix, masses in (("", learned), ("exact_", exact)):
        error = masses @ grid - theta
        report[f"{prefix}signed"] = float(error.mean())
        report[f"{prefix}rmse"] = float(error.square().mean().sqrt())
    return report


def metric_agreement(ctx):
    """How far the learned posteriors are from the exact ones: mean-θ error and KL divergence."""
    learned, exact = grid_posteriors(ctx)
    grid = theta_grid(ctx)
    mean_error = (learned @ grid - exact @ grid).abs()
    tiny = torch.finfo(torch.float64).tiny
    kl = (exact * (torch.log(exact + tiny) - torch.log(learned + tiny))).sum(1)
    return {"posterior_mean_abs_error": float(mean_error.mean()), "kl_exact_to_learned": float(kl.mean()),
            "cases": len(learned)}


def metric_classification(ctx):
    """Held-out test BCE, accuracy and AUC of the classifier."""
    inputs = torch.from_numpy(np.asarray(ctx.data.array("test_inputs")))
    labels = torch.from_numpy(np.asarray(ctx.data.array("test_labels")))
    with torch.no_grad():
        logits = torch.cat([ctx.model(chunk.to(ctx.runtime.device)).cpu() for chunk in inputs.split(65_536)])
    return inference.classification_metrics(logits, labels)


# ---------------------------------------------------------------- analysis: figures

def draw_posteriors(ctx, figure):
    """The learned and the exact posterior of the first four cases, with the true θ."""
    learned, exact = grid_posteriors(ctx)
    theta, grid = ctx.require("cases").array("theta"), theta_grid(ctx).numpy()
    cell = grid[1] - grid[0]
    for index, axis in enumerate(figure.subplots(1, min(4, len(theta)), squeeze=False)[0]):
        axis.plot(grid, exact[index].numpy() / cell, color="black", label="exact")
        axis.plot(grid, learned[index].numpy() / cell, color="tab:blue", label="learned")
        axis.axvline(theta[index], color="tab:red", linestyle=":", label="true θ")
        axis.set_xlabel("θ = log rate")
    figure.axes[0].set_ylabel("posterior density")
    figure.axes[0].legend(fontsize="small")


# ---------------------------------------------------------------- the analysis

class DecayAnalysis:
    """Analysis side: three products (cases, learned and exact scores), five metrics, one figure."""

    SOURCES = ()      # besides each build function and the module-level helpers it calls

    products = {
        "cases": Product(build_cases, lambda ctx: {
            "problem": ctx.problem, "prior": ctx.prior, "seed": ctx.settings["seed"],
            "cases": ctx.analysis_settings["inference"]["cases"]}),
        "learned": Product(build_learned, lambda ctx: {"grid_points": ctx.analysis_settings["inference"]["grid_points"]},
                           needs=("cases",), uses_model=True),
        "exact": Product(build_exact, lambda ctx: {"grid_points": ctx.analysis_settings["inference"]["grid_points"]},
                         needs=("cases",)),
    }
    metrics = {
        "classification": Metric(metric_classification),
        "coverage": Metric(metric_coverage, needs=("cases", "learned", "exact")),
        "width": Metric(metric_width, needs=("learned", "exact")),
        "bias": Metric(metric_bias, needs=("cases", "learned", "exact")),
        "agreement": Metric(metric_agreement, needs=("learned", "exact")),
    }
    plots = {"posteriors": Figure(draw_posteriors)}
    cohort_plots = {}

    def __init__(self, settings, experiment):
        self.settings = settings
        self.experiment = experiment

    def validate(self):
        """Check the `inference` section."""
        section = self.settings["inference"]
        known_keys(section, ("cases", "grid_points", "levels"), "inference")
        integer(require(section, "cases", "inference"), "inference.cases", 1, 10**7)
        integer(require(section, "grid_points", "inference"), "inference.grid_points", 2, 10**6)
        levels = require(section, "levels", "inference")
        if not isinstance(levels, list) or not levels:
            raise SettingsError(f"inference.levels: expected a non-empty list of levels, got {levels!r}")
        for index, level in enumerate(levels):
            number(level, f"inference.levels[{index}]", 0, 1, low_open=True)

    def workload(self, member):
        """Model evaluations, bytes written and grid points of one member's analysis."""
        section = self.settings["inference"]
        cases, points = section["cases"], section["grid_points"]
        waiting_times = self.experiment.problem()["waiting_times"]
        return {"model_evaluations": cases * points, "candidate_points": points,
                "saved_bytes": 8 * cases * (waiting_times + 1 + 2 * points)}
