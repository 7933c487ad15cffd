"""The bundled ratio-estimator networks: an MLP or a residual net returning one logit per row,
optionally behind input standardisation.

With `model.standardize` on, the network sees (input − shift) / scale, where shift and scale
are the means and standard deviations of the training inputs, fitted once before training
(`fit_standardization`) and kept as buffers in the state dict: every later evaluation, and
`restore`, applies the same transform. `restandardize` gives a trained network a new shift
and scale without changing its function (a warm round, docs/rounds.md).

A study's own embedding network (docs/extending.md, "Your own network") sits between the
standardisation and the classifier: `Embedded` hands the first d columns of each row (x)
to the embedding and the classifier sees [embedding(x), θ].
"""

from typing import Any

import torch

from settings import SettingsError, integer, known_keys, number, one_of, require

__all__ = [
    "MLP",
    "ResidualBlock",
    "ResidualNet",
    "check_model_settings",
    "build_classifier",
    "build_network",
    "Embedded",
    "embedding_features",
    "Standardized",
    "fit_standardization",
    "first_linear",
    "restandardize",
]

MODEL_KEYS = ("kind", "hidden", "activation", "dropout", "width", "blocks", "standardize")
ACTIVATIONS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU}
MAX_WIDTH = 1 << 16
NEAR_ZERO = 1e-3  # the bound of a residual branch's last layer's initial weights


class MLP(torch.nn.Module):
    """Linear+activation per hidden width (optional dropout), then a Linear to one logit."""

    def __init__(self, input_size: int, hidden: list[int], activation: str, dropout: float) -> None:
        """Stack the layers."""
        super().__init__()
        layers, width = [], input_size
        for size in hidden:
            layers += [torch.nn.Linear(width, size), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(torch.nn.Dropout(dropout))
            width = size
        layers.append(torch.nn.Linear(width, 1))
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """One logit per row, shape (rows,)."""
        return self.layers(inputs).squeeze(-1)


class ResidualBlock(torch.nn.Module):
    """h + Linear(dropout(act(Linear(act(h))))): activations inside the branch only, so the identity path
    carries h unchanged; the branch's last layer starts near zero, so every block starts as the identity."""

    def __init__(self, width: int, activation: str, dropout: float) -> None:
        """Two width-preserving Linear layers around an activation and dropout."""
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.outer = torch.nn.Linear(width, width)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = torch.nn.Dropout(dropout)
        torch.nn.init.uniform_(self.outer.weight, -NEAR_ZERO, NEAR_ZERO)
        torch.nn.init.uniform_(self.outer.bias, -NEAR_ZERO, NEAR_ZERO)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        return h + self.outer(self.dropout(self.activation(self.inner(self.activation(h)))))


class ResidualNet(torch.nn.Module):
    """Input Linear to width, residual blocks, final Linear to one logit."""

    def __init__(self, input_size: int, width: int, blocks: int, activation: str, dropout: float) -> None:
        """Stack the input layer, blocks and output layer."""
        super().__init__()
        self.input = torch.nn.Linear(input_size, width)
        self.blocks = torch.nn.Sequential(*[ResidualBlock(width, activation, dropout) for _ in range(blocks)])
        self.output = torch.nn.Linear(width, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """One logit per row, shape (rows,)."""
        return self.output(self.blocks(self.input(inputs))).squeeze(-1)


def check_model_settings(model: Any, path: str = "model") -> None:
    """Validate the model section (the input size is derived, never configured)."""
    if not isinstance(model, dict):
        raise SettingsError(f"{path}: expected a dict, got {type(model).__name__}")
    if "input_size" in model:
        raise SettingsError(f"{path}.input_size: the input size is derived (d + p); remove this key")
    known_keys(model, MODEL_KEYS, path)
    kind = one_of(require(model, "kind", path), ("mlp", "residual"), f"{path}.kind")
    if not isinstance(model.get("standardize", False), bool):
        raise SettingsError(f"{path}.standardize: expected True or False, got {model['standardize']!r}")
    one_of(require(model, "activation", path), tuple(ACTIVATIONS), f"{path}.activation")
    if not 0.0 <= number(model.get("dropout", 0.0), f"{path}.dropout", 0.0, 1.0) < 1.0:
        raise SettingsError(f"{path}.dropout: must be in [0, 1), got {model['dropout']}")
    if kind == "mlp":
        hidden = require(model, "hidden", path)
        if not isinstance(hidden, (list, tuple)) or len(hidden) > 100:
            raise SettingsError(f"{path}.hidden: expected a list of up to 100 layer widths such as [32, 32]")
        for i, size in enumerate(hidden):
            integer(size, f"{path}.hidden[{i}]", 1, MAX_WIDTH)
    else:
        integer(require(model, "width", path), f"{path}.width", 1, MAX_WIDTH)
        integer(require(model, "blocks", path), f"{path}.blocks", 0, 1000)


def build_classifier(model_settings: dict[str, Any], input_size: int) -> torch.nn.Module:
    """The MLP or residual classifier the `model` section describes, for inputs of width input_size."""
    dropout = float(model_settings.get("dropout", 0.0))
    activation = model_settings["activation"]
    if model_settings["kind"] == "mlp":
        return MLP(input_size, list(model_settings["hidden"]), activation, dropout)
    return ResidualNet(input_size, model_settings["width"], model_settings["blocks"], activation, dropout)


def build_network(
    model_settings: dict[str, Any],
    input_size: int,
    standardize: bool = True,
    embedding: torch.nn.Module | None = None,
    observation_size: int | None = None,
) -> torch.nn.Module:
    """The network for rows [x, θ] of width input_size (= d + p); `standardize` is the default of model.standardize.

    With an `embedding` (a module mapping x (n, d) to features (n, k); d = observation_size),
    the classifier reads [embedding(x), θ], of width k + p, and the standardisation still
    applies to the whole row [x, θ] before it.
    """
    check_model_settings(model_settings)
    if embedding is None:
        network = build_classifier(model_settings, input_size)
    else:
        if observation_size is None:
            raise ValueError("build_network: an embedding needs observation_size, the d columns of x it reads")
        features = embedding_features(embedding, observation_size)
        classifier = build_classifier(model_settings, features + input_size - observation_size)
        network = Embedded(embedding, classifier, observation_size)
    return Standardized(network, input_size) if model_settings.get("standardize", standardize) else network


class Embedded(torch.nn.Module):
    """A classifier on [embedding(x), θ], for rows [x, θ] whose first `observation_size` columns are x."""

    def __init__(self, embedding: torch.nn.Module, classifier: torch.nn.Module, observation_size: int) -> None:
        """Keep both networks; their parameters train together."""
        super().__init__()
        self.embedding = embedding
        self.classifier = classifier
        self.observation_size = observation_size

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The classifier's logits of [embedding(x), θ]."""
        x, theta = inputs[:, : self.observation_size], inputs[:, self.observation_size :]
        return self.classifier(torch.cat([self.embedding(x), theta], dim=1))

    def extra_repr(self) -> str:
        """The observation's width, shown in the repr."""
        return f"observation_size={self.observation_size}"


def embedding_features(embedding: torch.nn.Module, observation_size: int, where: str = "embedding()") -> int:
    """The width k of an embedding's features, from one call on x = zeros (2, observation_size) in eval mode.

    Eval mode and no gradient: the probe draws no dropout noise, so the classifier built
    after it gets the same initial weights whatever the embedding holds.
    """
    if not isinstance(embedding, torch.nn.Module):
        raise SettingsError(
            f"{where}: expected a torch.nn.Module mapping x (n, {observation_size}) to features "
            f"(n, k), got {type(embedding).__name__}"
        )
    training = embedding.training
    embedding.eval()
    try:
        with torch.no_grad():
            features = embedding(torch.zeros(2, observation_size))
    except KeyboardInterrupt:  # a stop (runtime.Interrupted is also an Exception) is never swallowed
        raise
    except Exception as error:  # the study's code: any failure is reported as a settings error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SettingsError(f"{where}: calling it on x (2, {observation_size}) failed: {first}") from None
    finally:
        embedding.train(training)
    if (
        not isinstance(features, torch.Tensor)
        or features.dim() != 2
        or features.shape[0] != 2
        or features.shape[1] == 0
    ):
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise SettingsError(
            f"{where}: for x (2, {observation_size}) it returned {shape}; it must return features "
            "(n, k), one row of k numbers per row of x"
        )
    return int(features.shape[1])


class Standardized(torch.nn.Module):
    """A network applied to standardised inputs; the shift and scale are buffers saved with the weights."""

    shift: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scale: torch.Tensor

    def __init__(self, network: torch.nn.Module, input_size: int) -> None:
        """Wrap `network`; the transform is the identity until fitted."""
        super().__init__()
        self.network = network
        self.register_buffer("shift", torch.zeros(input_size))
        self.register_buffer("scale", torch.ones(input_size))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The network's logits of (inputs − shift) / scale."""
        return self.network((inputs - self.shift) / self.scale)


# Columns whose spread is below this are constant: they are shifted but not divided by ~0.
MIN_SCALE = 1e-12


def first_linear(network: torch.nn.Module) -> torch.nn.Linear | None:
    """The Linear layer that reads the standardised row first, or None (a study's embedding reads it)."""
    if isinstance(network, ResidualNet):
        return network.input
    if isinstance(network, MLP) and isinstance(network.layers[0], torch.nn.Linear):
        return network.layers[0]
    return None


def restandardize(model: torch.nn.Module, shift: torch.Tensor, scale: torch.Tensor) -> bool:
    """Give a Standardized model a new shift and scale, folding the change of coordinates into its first
    Linear layer so that its function stays the same; False (nothing changed) when there is none to fold into.

    With z = (v − shift) / scale the old transform is z_old = (shift − shift_old) / scale_old
    + (scale / scale_old) z, so W z_old + b = W' z + b' with W' = W · scale / scale_old and
    b' = b + W (shift − shift_old) / scale_old.
    """
    if not isinstance(model, Standardized):
        return False
    first = first_linear(model.network)
    if first is None:
        return False
    with torch.no_grad():
        shift, scale = (torch.as_tensor(t, dtype=model.shift.dtype) for t in (shift, scale))
        first.bias.add_(first.weight @ ((shift - model.shift) / model.scale).to(first.weight.dtype))
        first.weight.mul_((scale / model.scale).to(first.weight.dtype))
        model.shift.copy_(shift)
        model.scale.copy_(scale)
    return True


def fit_standardization(model: torch.nn.Module, inputs: torch.Tensor) -> None:
    """Set a Standardized model's shift and scale from the training inputs (rows, features); others are left alone."""
    if not isinstance(model, Standardized):
        return
    inputs = torch.as_tensor(inputs, dtype=torch.float64)
    scale = inputs.std(0) if inputs.shape[0] > 1 else torch.ones(inputs.shape[1], dtype=torch.float64)
    with torch.no_grad():
        model.shift.copy_(inputs.mean(0))
        model.scale.copy_(torch.where(scale > MIN_SCALE, scale, torch.ones_like(scale)))
