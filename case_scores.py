"""Scores of blocks of cases: each case's ensemble score from a network (ensemble_scores) or its exact
log-likelihood (exact_scores) on its candidates, and how the analysis sizes that work on a device
(call_policy, cases_per_block).

Generic on purpose: it works on callables and tensors and knows no study.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = [
    "CallPolicy",
    "EVAL_BLOCK_ROWS",
    "Evaluations",
    "ROW_PAD",
    "accepts_column_rows",
    "call_policy",
    "cases_per_block",
    "ensemble_scores",
    "exact_scores",
    "network_row_bytes",
]

LogitFn = Callable[[torch.Tensor], torch.Tensor]  # rows (n, d + p) -> one logit per row

# Network calls always see this many rows (whole candidates, last block padded) when
# chunk_rows allows it, so ensemble scores are bitwise independent of chunk_rows.
EVAL_BLOCK_ROWS = 8192
# Smaller calls are padded to a multiple of this, so every row sits in a full BLAS tile.
ROW_PAD = 64


class CallPolicy(NamedTuple):
    """How the analysis sizes its work on a device: rows per network call, bytes per block of cases."""

    rows_per_call: int
    block_bytes: int


CPU_BLOCK_BYTES = 256 << 20  # a block of cases' refinement arrays on the host
CUDA_MEMORY_SHARE = 0.25  # of the free device memory: a network call's activations, and a block's arrays
CUDA_MAX_ROWS = 1 << 24  # the most rows of one network call on CUDA
# ensemble_scores builds the rows of several network calls at once (several of EVAL_BLOCK_ROWS on
# the CPU), in the slots of one buffer that walk through the calls side by side (slot j holds calls
# j·S, j·S + 1, ...): a slot keeps its case's observations from call to call, the points of all
# slots are one copy, and nothing but the network runs between the calls. On the CPU each small
# operation between two calls took about 100 µs, a few hundred rows' time.
CALL_GROUP_BYTES = 4 << 20


def call_policy(device_type: str, chunk_rows: int, row_bytes: int = 1024, free_bytes: int | None = None) -> CallPolicy:
    """Rows per network call and the bytes a block of cases may use, for a device type.

    On the CPU a call holds EVAL_BLOCK_ROWS rows, whose activations stay in cache. On
    CUDA a call holds as many rows as a share of the free memory allows at `row_bytes`
    each, up to 2^24 (about 9.5 million for the bundled network at d = 6 with 80 GB free); `free_bytes`
    defaults to what the device reports. chunk_rows caps the rows of a call on every device.
    """
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    if device_type != "cuda":
        return CallPolicy(min(EVAL_BLOCK_ROWS, int(chunk_rows)), CPU_BLOCK_BYTES)
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info()[0]
    budget = int(CUDA_MEMORY_SHARE * free_bytes)
    rows = min(max(budget // max(int(row_bytes), 1), ROW_PAD), CUDA_MAX_ROWS)
    return CallPolicy(min(rows, int(chunk_rows)), budget)


def network_row_bytes(model: torch.nn.Module, input_width: int) -> int:
    """Bytes one row of a network call takes at its widest: the input, and two float32 activations of
    every layer the network has (a generous bound for an MLP or residual net)."""
    widths = [module.out_features for module in model.modules() if isinstance(module, torch.nn.Linear)]
    return 4 * (input_width + 2 * sum(widths)) if widths else 4096


def cases_per_block(cases: int, case_bytes: int, block_bytes: int) -> int:
    """Cases refined together: as many as fit into block_bytes at case_bytes each (at least one)."""
    return max(1, min(int(cases), int(block_bytes) // max(int(case_bytes), 1)))


def _call_layout(m, cases, n, rows_per_call):
    """How ensemble_scores cuts `cases` cases of n candidates (m rows each) into network calls of at
    most rows_per_call rows: (block, span, together).

    Every call holds `block` candidate slots of one case or of `together` whole cases, so each
    call's observations are one broadcast copy. A case of at least a call's worth of candidates
    takes calls of its own, evenly filled (span = their slots, n and a little padding);
    smaller cases share calls whole, as few calls as fit, evenly filled (span = n, together ≥ 1).
    """
    largest = max(1, min(int(rows_per_call) // m, cases * n))
    if n >= largest:
        per_case = -(-n // largest)
        block = -(-n // per_case)
        return block, per_case * block, 0
    calls = -(-cases // (largest // n))
    together = -(-cases // calls)
    return together * n, n, together


class Evaluations:
    """What a product's network calls did: rows evaluated, rows the calls held (padding too), calls."""

    def __init__(self) -> None:
        self.rows = self.call_rows = self.calls = 0

    def add(self, rows: int, call_rows: int, calls: int = 1) -> None:
        """Count `calls` calls of call_rows rows in all, `rows` of them real."""
        self.rows += rows
        self.call_rows += call_rows
        self.calls += calls


def accepts_column_rows(logit_fn: LogitFn, width: int, device: torch.device | str) -> bool:
    """Whether logit_fn gives the same logits, to float32 rounding, for rows held column by column (the
    transpose of a (width, rows) buffer) as for the same rows made contiguous: a network that reshapes its
    input with `view`, or whose arithmetic depends on the layout, is given contiguous rows instead. (A BLAS
    kernel may round a transposed operand otherwise, in the last bits: that is no reason to copy.)"""
    buffer = torch.randn(width, 2 * ROW_PAD, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        try:
            columns, contiguous = logit_fn(buffer.T).reshape(-1), logit_fn(buffer.T.contiguous()).reshape(-1)
            return columns.shape == contiguous.shape and bool(torch.allclose(columns, contiguous, 1e-5, 1e-5))
        except KeyboardInterrupt:  # a stop (runtime.Interrupted is also an Exception) is never swallowed
            raise
        except Exception:  # whatever the network objects to, contiguous rows are what it was always given
            return False


def _call_groups(calls, call_floats):
    """(group, stride): the calls whose rows (call_floats float32 each) one buffer of CALL_GROUP_BYTES
    holds at once, and the stride of its slots: slot j of the g-th group holds call j·stride + g."""
    group = max(1, min(calls, CALL_GROUP_BYTES // (4 * call_floats)))
    return group, -(-calls // group)


def _theta_rows(points, span, length, device):
    """The candidates (B, n, p) as p float32 rows of `length`, each coordinate a row: case b's
    candidates from b·span on, its padding and the rows' tail zero."""
    cases, n, p = points.shape
    theta = torch.zeros(p, length, dtype=torch.float32, device=device)
    theta[:, : cases * span].view(p, cases, span)[:, :, :n].copy_(points.permute(2, 0, 1))
    return theta


def ensemble_scores(
    logit_fn: LogitFn,
    observations: torch.Tensor,
    points: torch.Tensor,
    rows_per_call: int,
    counted: Evaluations | None = None,
    column_rows: bool = True,
) -> torch.Tensor:
    """S(θ) = Σ_k logit(x_k, θ) of every case's candidates: observations (B, m, d), points (B, n, p)
    -> (B, n) float64 on the observations' device. A single case's (m, d) and (n, p) give (n,).

    Each network call holds whole candidates (all m observations) of one case, or of several
    whole cases (see _call_layout), observation by observation ([x_1, θ] for every candidate
    of the call, then [x_2, θ], ...), in a (d + p, rows) buffer padded to a multiple of ROW_PAD
    and built a few calls at a time (see CALL_GROUP_BYTES). logit_fn sees a call's rows as the buffer's
    transpose, (rows, d + p) column by column (a contiguous copy with column_rows=False, see accepts_column_rows),
    and must return one new logit per row each call: they are summed after the group. Every row is computed on
    its own, so a case's scores do not depend on the other cases of its block: to float32 rounding, since a
    call of another shape may get another BLAS kernel (docs/devices.md). `counted` counts the calls.
    """
    if observations.dim() == 2:
        return ensemble_scores(logit_fn, observations[None], points[None], rows_per_call, counted, column_rows)[0]
    beside = observations.to(torch.float32).permute(0, 2, 1)[..., None]  # each case's (d, m, 1), a copy source
    (cases, d, m, _), (_, n, p) = beside.shape, points.shape
    block, span, together = _call_layout(m, cases, n, rows_per_call)
    count = cases * span  # candidate slots: each case's n and its padding
    calls, width = -(-count // block), -(-block * m // ROW_PAD) * ROW_PAD
    group, stride = _call_groups(calls, (d + p) * width)
    theta = _theta_rows(points, span, group * stride * block, beside.device)
    buffer = torch.zeros(d + p, group, width, dtype=torch.float32, device=beside.device)
    slots = buffer.view(d + p, group * width).T.split(width)
    scores = torch.empty(stride, group, block, dtype=torch.float64, device=beside.device)
    # Every view the loop uses is taken here: between network calls each operation is slow (see
    # CALL_GROUP_BYTES), so a group of calls takes one copy of its θ, one stack and one sum.
    thetas = buffer[d:, :, : block * m].view(p, group, m, block)
    sources = theta.view(p, group, stride, 1, block).unbind(2)  # each group's θ, (p, group, 1, block)
    observed = buffer[:d, :, : block * m].view(d, group, m, block).unbind(1)  # each slot's observations
    held = [None] * group  # the first case whose observations fill a slot
    with torch.no_grad():
        for g, (source, summed) in enumerate(zip(sources, scores)):
            k = min(group, -(-(calls - g) // stride))  # the slots with a call in this group
            _refresh_observations(
                observed, held, beside, [(j * stride + g) * block // span for j in range(k)], together
            )
            thetas.copy_(source)  # slots past k compute nothing that is kept
            _sum_logits(
                torch.stack([logit_fn(slots[j] if column_rows else slots[j].contiguous()) for j in range(k)]),
                width,
                m,
                summed[:k],
            )
    if counted is not None:
        counted.add(cases * n * m, calls * width, calls)
    return scores.transpose(0, 1).reshape(-1)[:count].view(cases, span)[:, :n]


def _sum_logits(logits, width, m, out):
    """Sum each call's logits (a group's, stacked) over its candidates' m observations, in float64, into
    out (calls, candidates); a network that gives other than one logit per row is refused."""
    calls, block = out.shape
    if logits.numel() != calls * width:
        raise ValueError(
            f"the network gave logits of shape {tuple(logits.shape[1:])} for {width} rows; it must "
            "give one logit per row"
        )
    torch.sum(logits.as_strided((calls, m, block), (width, block, 1)).double(), dim=1, out=out)


def _refresh_observations(observed, held, beside, firsts, together):
    """Give slot j (observed[j], (d, m, block)) the observations of its call, whose first case is
    firsts[j] (see _fill_observations), unless it holds them already; held[j], the first case
    of the call whose observations slot j holds, is kept up to date."""
    for j, first in enumerate(firsts):
        if held[j] != first:
            _fill_observations(observed[j], beside, first, together)
            held[j] = first


def _fill_observations(observed, beside, first, together):
    """Put the observations of a call's cases beside its candidates, in observed (d, m, block):
    case `first`'s alone (together = 0), or `together` whole cases from `first` on (fewer at the
    end), each beside its own n = block / together candidates. beside (B, d, m, 1) is the
    observations x (B, m, d) as x.permute(0, 2, 1)[..., None]. One broadcast copy either way."""
    if not together:
        observed.copy_(beside[first])
        return
    d, m, block = observed.shape
    cases = beside[first : first + together]
    observed.view(d, m, together, block // together)[:, :, : cases.shape[0]].copy_(cases.permute(1, 2, 0, 3))


def exact_scores(
    log_likelihood: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    observations: torch.Tensor,
    points: torch.Tensor,
    chunk_rows: int = EVAL_BLOCK_ROWS,
) -> torch.Tensor:
    """Σ_k log p(x_k | θ) of every case's candidates, with `log_likelihood(x (c, m, d), θ (c, 1, p)) -> (c, m)`
    broadcasting: observations (B, m, d), points (B, n, p) -> (B, n) float64 on the observations'
    device; a single case's (m, d) and (n, p) give (n,). Each candidate's sum depends on its own
    rows alone, whatever chunk_rows is."""
    if observations.dim() == 2:
        return exact_scores(log_likelihood, observations[None], points[None], chunk_rows)[0]
    (cases, m, _), (_, n, p) = observations.shape, points.shape
    theta = points.to(observations.device).reshape(cases * n, 1, p)
    owner = torch.arange(cases, device=observations.device).repeat_interleave(n)
    block = max(1, int(chunk_rows) // m)
    scores = torch.empty(cases * n, dtype=torch.float64, device=observations.device)
    with torch.no_grad():
        for start in range(0, cases * n, block):
            chunk = theta[start : start + block]
            values = log_likelihood(observations[owner[start : start + block]], chunk).reshape(chunk.shape[0], m)
            scores[start : start + chunk.shape[0]] = values.to(torch.float64).sum(dim=1)
    return scores.reshape(cases, n)
