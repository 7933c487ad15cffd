"""The classifier two-sample test (C2ST): how well a small network tells two samples apart.

    c2st(samples, reference)     # 0.5: indistinguishable, 1.0: disjoint

The field scores a posterior's samples against reference draws this way (sbibm's C2ST):
both sets standardised by the reference's mean and sd, labelled 0 and 1, a ReLU classifier
of two hidden layers of 10·dim units, its k-fold cross-validated accuracy. Here in plain
torch, seeded, on one thread. `python nnpd.py infer RUN --reference FILE.npy` prints it.
"""

import math
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["c2st"]

Draws = np.ndarray | torch.Tensor | Sequence[Any]  # rows of draws, (n, p) or (n,)

C2ST_EPOCHS = 20  # passes over the training folds: enough to learn a shift or memorise repeated rows
C2ST_BATCH = 512
C2ST_RATE = 5e-3


def _classifier(width, hidden, generator):
    """A two-hidden-layer ReLU network's parameters, drawn as torch.nn.Linear draws them, from `generator`."""
    parameters = []
    for fan_in, fan_out in ((width, hidden), (hidden, hidden), (hidden, 1)):
        bound = 1 / math.sqrt(fan_in)
        for shape in ((fan_in, fan_out), (fan_out,)):
            parameters.append((torch.rand(shape, generator=generator) * 2 - 1).mul_(bound).requires_grad_())
    return parameters


def _logits(parameters, x):
    """The classifier's logits (n,) at rows x (n, width)."""
    w1, b1, w2, b2, w3, b3 = parameters
    return (torch.relu(torch.relu(x @ w1 + b1) @ w2 + b2) @ w3 + b3)[:, 0]


def _fold_accuracy(x, y, test, generator, epochs, batch_rows):
    """Held-out accuracy on rows `test` of a classifier trained by Adam in minibatches on the other rows."""
    train = torch.ones(x.shape[0], dtype=torch.bool)
    train[test] = False
    train_x, train_y = x[train], y[train]
    parameters = _classifier(x.shape[1], 10 * x.shape[1], generator)
    optimizer = torch.optim.Adam(parameters, lr=C2ST_RATE)
    for _ in range(epochs):
        for batch in torch.randperm(train_x.shape[0], generator=generator).split(batch_rows):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                _logits(parameters, train_x[batch]), train_y[batch]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        return float(((_logits(parameters, x[test]) > 0).float() == y[test]).float().mean())


def c2st(
    samples: Draws, reference: Draws, folds: int = 5, seed: int = 0, epochs: int = C2ST_EPOCHS, batch: int = C2ST_BATCH
) -> float:
    """Classifier two-sample test: the k-fold cross-validated accuracy of an MLP telling samples from reference
    (0.5: indistinguishable, 1.0: disjoint).

    As the field computes it (sbibm's C2ST): both sets standardised by the reference's mean
    and sd, labelled 0 and 1, a classifier of two hidden layers of 10·dim ReLU units, the
    accuracy averaged over the folds. Plain torch, seeded and on one thread: the same inputs
    and seed give the same value. `epochs` passes of minibatches of `batch` rows train each
    fold's classifier; the defaults are cheaper than sbibm's (C2ST_EPOCHS minibatch epochs, not
    training to convergence), so it sees repeated rows less: 10,000 draws resampled from
    3,500 distinct exact ones score about 0.64 here.
    """
    a = torch.as_tensor(np.asarray(samples), dtype=torch.float64).reshape(len(samples), -1)
    b = torch.as_tensor(np.asarray(reference), dtype=torch.float64).reshape(len(reference), -1)
    mean, sd = b.mean(dim=0), b.std(dim=0).clamp(min=1e-12)
    x = ((torch.cat([a, b]) - mean) / sd).float()
    y = torch.cat([torch.zeros(a.shape[0]), torch.ones(b.shape[0])])
    generator = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(x.shape[0], generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: more threads only contend (ten times slower on busy cores)
    try:
        return sum(_fold_accuracy(x, y, order[k::folds], generator, epochs, batch) for k in range(folds)) / folds
    finally:
        torch.set_num_threads(threads)
