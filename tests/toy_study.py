"""A non-Gaussian study used to show the framework runs other experiments unchanged.

θ is a slope in [-1, 1]; an observation is x = 2θ + N(0, 0.3²). Its analysis has one
product (the model's log ratio on a θ grid for a fixed ensemble) and two metrics.
"""

import numpy as np
import torch

import analysis_metrics
import runtime
import trainer
from study import Metric, Product


class SlopeExperiment:
    """Train a ratio estimator for the slope of a one-line simulator."""

    DATA_SOURCES = ()
    MODEL_SOURCES = (trainer,)

    def __init__(self, settings):
        self.settings = settings

    def validate(self):
        """Only the trainer's settings need checking here."""
        trainer.check_training_settings(self.settings["training"])

    def members(self):
        """Replicas of the one prior."""
        return [
            {"name": f"flat-r{r}", "prior": "flat", "replica": r} for r in range(self.settings["cohort"]["replicas"])
        ]

    def problem(self, member=None):
        """The noise level is the whole problem."""
        return self.settings["problem"]

    def prior(self, member):
        """A flat prior on [-1, 1]."""
        return None

    def input_size(self):
        """One observation and one parameter."""
        return 2

    def data_recipe(self, member):
        """Data depends on the problem, the sizes and the member."""
        return {
            "problem": self.settings["problem"],
            "data": self.settings["data"],
            "member": member["name"],
            "seed": self.settings["seed"],
        }

    def simulate(self, theta, generator):
        """x = 2θ + noise."""
        noise = self.settings["problem"]["noise"]
        return 2 * theta + noise * torch.randn(theta.shape, generator=generator, dtype=theta.dtype)

    def sample_data(self, member):
        """Balanced joint/marginal pairs for each split."""
        arrays = {}
        for split, rows in self.settings["data"].items():
            generator = runtime.seeded_generator(self.settings["seed"], member["name"], split)
            theta = torch.rand(rows, generator=generator, dtype=torch.float64) * 2 - 1
            x = self.simulate(theta, generator)
            shuffled = x[torch.randperm(rows, generator=generator)]
            labels = torch.arange(rows) < rows // 2
            x = torch.where(labels, x, shuffled)
            inputs = torch.stack([x, theta], 1).float()
            if self.settings["problem"].get("poison") and split == "train":
                inputs[rows // 3, 0] = float("inf")  # a broken simulation: training must stop on it
            arrays[f"{split}_inputs"] = inputs.numpy()
            arrays[f"{split}_labels"] = labels.float().numpy()
        return arrays

    def model_recipe(self, member):
        """The model depends on its width and the training settings."""
        return {"model": self.settings["model"], "training": self.settings["training"], "member": member["name"]}

    def build_model(self, member):
        """A small tanh network returning one logit per row."""
        torch.manual_seed(runtime.derived_seed(self.settings["seed"], member["name"]))
        width = self.settings["model"]["width"]
        network = torch.nn.Sequential(
            torch.nn.Linear(2, width), torch.nn.Tanh(), torch.nn.Linear(width, 1), torch.nn.Flatten(0)
        )
        return network

    def train(self, member, model, data, rt, hooks=None):
        """The bundled trainer."""
        tensors = {
            name: torch.from_numpy(np.asarray(data.array(name)))
            for name in ("train_inputs", "train_labels", "validation_inputs", "validation_labels")
        }
        return trainer.train(model, tensors, self.settings["training"], rt, self.settings["seed"], hooks)

    def workload(self, member):
        """Examples seen in training and the network's size."""
        width = self.settings["model"]["width"]
        return {
            "training_examples": self.settings["data"]["train"] * self.settings["training"]["epochs"],
            "network_parameters": 4 * width + 1,
        }

    def describe(self, member):
        """Nothing more to say than the settings."""
        return {"simulator": "x = 2θ + noise"}


def build_scan(ctx, writer):
    """The summed logit over an ensemble observed at θ = truth, on a θ grid."""
    truth = ctx.analysis_settings["inference"]["truth"]
    generator = ctx.generator("ensemble")
    x = ctx.experiment.simulate(torch.full((20,), truth, dtype=torch.float64), generator)
    grid = torch.linspace(-1, 1, 201, dtype=torch.float64)
    rows = torch.stack([x.repeat_interleave(len(grid)), grid.repeat(len(x))], 1).float()
    with torch.no_grad():
        scores = ctx.model(rows).double().reshape(len(x), len(grid)).sum(0)
    writer.array("grid", grid.numpy())
    writer.array("scores", scores.numpy())
    return {"truth": truth}


def metric_slope(ctx):
    """The grid point of highest summed log ratio against the truth."""
    scan = ctx.require("scan")
    best = float(scan.array("grid")[np.argmax(scan.array("scores"))])
    return {"estimate": best, "truth": scan.metadata["truth"]}


def metric_accuracy(ctx):
    """Accuracy on the test split."""
    inputs = torch.from_numpy(np.asarray(ctx.data.array("test_inputs")))
    labels = torch.from_numpy(np.asarray(ctx.data.array("test_labels")))
    with torch.no_grad():
        return analysis_metrics.classification_metrics(ctx.model(inputs), labels)


class SlopeAnalysis:
    """One product, two metrics."""

    SOURCES = ()
    products = {
        "scan": Product(build_scan, lambda ctx: {"truth": ctx.analysis_settings["inference"]["truth"]}, uses_model=True)
    }
    metrics = {"slope": Metric(metric_slope, needs=("scan",)), "accuracy": Metric(metric_accuracy)}
    plots, cohort_plots = {}, {}

    def __init__(self, settings, experiment):
        self.settings = settings
        self.experiment = experiment

    def validate(self):
        """Nothing beyond the structure."""

    def workload(self, member):
        """201 grid points times 20 observations."""
        return {"model_evaluations": 201 * 20, "saved_bytes": 201 * 16, "candidate_points": 201}
