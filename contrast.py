"""Contrasting pairs for ratio estimation: every simulation a joint pair, re-paired in every batch.

A simulation (θ_i, x_i) is a draw of the joint p(θ, x). Pairing x_i with the θ of another
row of the same global batch gives a draw of the product p(θ) p(x) at no simulator cost, so
every simulation serves twice, and the pairs are new in every batch and epoch. The rows
a batch contrasts its x with are its *atoms*: for row i, K indices of other rows, each
uniform over them and independent (with replacement), drawn from a stream that depends
only on the training seed, the epoch and the batch, so every DDP rank derives the same
atoms for the global batch and a resumed training draws them again.

Two losses read a row's logits f_0 = f(x_i, θ_i) and f_k = f(x_i, θ_{a_ik}), k = 1..K:

- binary (NRE-A, `objective` "bce"/"balanced", K = 1): the joint row has label 1, the
  re-paired row label 0; the loss is the BCE of the 2B rows of a global batch of B.
- contrastive (NRE-C, Miller et al. 2022, `objective` "contrastive", K = `classes`,
  γ = `gamma`): a (K+1)-way classification between "all K atoms are from the product"
  (class 0, prior weight p_0 = 1/(1+γ)) and "atom k is the joint one" (p_joint = γ/(1+γ)),
  with q(y=0) = K / (K + γ Σ_k r_k) and q(y=k) = γ r_k / (K + γ Σ_j r_j) for r = exp f:

      ℓ_i = −p_0 log[K / (K + γ Σ_{k=1..K} e^{f_k})]
            −p_joint log[γ e^{f_0} / (K + γ e^{f_0} + γ Σ_{k=1..K−1} e^{f_k})]

  The class-0 term contrasts the K atoms, the joint term θ_i with the first K − 1 of them
  (each term's expectation is that of independent draws). The Bayes-optimal f is
  log p(x|θ)/p(x) for every K and γ; K = 1 with γ = 1 is half the pair's BCE. NRE-B
  (a softmax over θ_i and K − 1 atoms) is the limit γ → ∞ of the joint term.
"""

import math

import torch

import runtime

__all__ = ["batch_atoms", "fixed_atoms", "pair_rows", "fixed_pairs", "binary_labels", "contrastive_losses"]


def _atoms(own: torch.Tensor, pool: int, classes: int, generator: torch.Generator) -> torch.Tensor:
    """(n, classes) indices in [0, pool), each uniform over the pool's rows other than `own`."""
    offsets = torch.randint(1, pool, (own.shape[0], classes), generator=generator)
    return (own[:, None] + offsets) % pool


def batch_atoms(start: int, stop: int, classes: int, seed: int, epoch: int, batch: int) -> torch.Tensor:
    """Atoms (B, classes) of the global batch [start, stop) of an epoch's order, as positions in that order.

    A batch of one row contrasts with a neighbour: the row before it, or after it in an
    epoch's first batch (an epoch holds at least two rows).
    """
    first, last = start, stop
    if stop - start < 2:
        first, last = (start - 1, stop) if start > 0 else (start, stop + 1)
    pool = last - first
    own = torch.arange(start - first, stop - first)
    generator = runtime.seeded_generator(seed, "atoms", epoch, batch)
    return _atoms(own, pool, classes, generator) + first


def fixed_atoms(rows: int, classes: int, seed: int) -> torch.Tensor:
    """Atoms (rows, classes) over a whole set, drawn once: the validation pairs stay the same every epoch."""
    if rows < 2:
        raise ValueError("contrasting pairs needs at least two validation rows")
    return _atoms(torch.arange(rows), rows, classes, runtime.seeded_generator(seed, "validation atoms"))


def pair_rows(x: torch.Tensor, theta: torch.Tensor, own: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Network inputs (n·(K+1), d+p): for each x_i, [x_i, θ_own_i] then [x_i, θ_a] for its K atoms a."""
    columns = torch.cat([own[:, None], atoms], dim=1)  # (n, K+1) indices into theta
    picked = theta.index_select(0, columns.reshape(-1))
    repeated = x.repeat_interleave(columns.shape[1], dim=0)
    return torch.cat([repeated, picked], dim=1)


def fixed_pairs(x: torch.Tensor, theta: torch.Tensor, seed: int) -> tuple:
    """Classifier rows of a held-out set, the same for every call with `seed`: (inputs (2n, d+p), labels (2n,)).

    Each simulation [x_i, θ_i] (label 1) is followed by [x_i, θ_j] (label 0), θ_j that of one
    other simulation drawn once.
    """
    atoms = fixed_atoms(x.shape[0], 1, seed)
    return pair_rows(x, theta, torch.arange(x.shape[0]), atoms), binary_labels(x.shape[0], "cpu")


def binary_labels(n: int, device) -> torch.Tensor:
    """Labels of `pair_rows` with one atom: 1 for each joint row, 0 for its re-paired row."""
    return torch.tensor([1.0, 0.0], device=device).repeat(n)


def contrastive_losses(logits: torch.Tensor, gamma: float) -> torch.Tensor:
    """The NRE-C loss ℓ_i of each row of logits (n, K+1), column 0 the joint pair (module docstring)."""
    n, columns = logits.shape
    classes = columns - 1
    log_gamma, log_k = math.log(gamma), math.log(classes)
    constant = torch.full((n, 1), log_k, dtype=logits.dtype, device=logits.device)
    marginal = log_k - torch.logsumexp(torch.cat([log_gamma + logits[:, 1:], constant], 1), 1)
    joint_terms = torch.cat([log_gamma + logits[:, :classes], constant], 1)
    joint = log_gamma + logits[:, 0] - torch.logsumexp(joint_terms, 1)
    return -(marginal + gamma * joint) / (1 + gamma)
