"""Cases on a design, a block at a time: which design a prior's cases get (an enumerated lattice,
a grid, Sobol points or the adaptive design), then each block of cases refined (adaptive.py) or
scored on the shared candidates, and summarised (hpd.py).

The analysis (nre_analysis.py) and one observation's posterior (posterior.py) both decide and
score through here (learned_scoring, exact_scoring), so a case's design, scores and summaries are
the same in both.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

import adaptive
import case_scores
import designs
import hpd
import runtime

__all__ = [
    "Candidates",
    "Design",
    "Scoring",
    "ScoreFn",
    "analyse_block",
    "blocks_of_cases",
    "case_bytes",
    "decide_design",
    "design_case_bytes",
    "exact_scoring",
    "learned_scoring",
    "network_precision",
    "shared_candidates",
]

ScoreFn = Callable[[torch.Tensor], Mapping[str, torch.Tensor]]  # points (B, n, p) -> {target: scores (B, n)}


class Candidates(NamedTuple):
    """A shared design: points (K, p) and their log measure (K,); the adaptive kind's coarse pass."""

    points: torch.Tensor
    log_measure: torch.Tensor

    def to(self, device: torch.device | str) -> Candidates:
        """The same candidates on `device`."""
        return Candidates(self.points.to(device), self.log_measure.to(device))


class Design(NamedTuple):
    """How a prior's cases are scored: the kind ('enumerate', 'grid', 'sobol' or 'adaptive'), the
    candidates' lattice steps (None: continuous) and, for refine_block, the refinement (its sizes
    None for a fixed design, which refines nothing)."""

    kind: str
    lattice: list[float | None]
    refinement: adaptive.Refinement


class Scoring(NamedTuple):
    """How a product scores blocks of cases: `scores(cases (B,), points (B, n, p)) -> {target: (B, n)}`
    on `device`, and the bytes a block of cases may use there."""

    scores: Callable[[torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]
    device: torch.device
    block_bytes: int


def decide_design(
    box: tuple[Any, Any], lattice_steps: Sequence[float | None], settings: Mapping[str, Any], targets: int, seed: int
) -> Design:
    """The design of a prior's cases: box (low, high) and its lattice steps, the analysis' `inference`
    settings, the number of targets scored together (they share the adaptive probes) and the
    training seed, from which the refined passes' seed is derived.

    The candidates settings are taken as given: native_grid_prior decides whether lattice axes
    keep their lattice (posterior.py sets it for lattice priors before deciding).
    """
    low, high = designs.as_f64(box[0]), designs.as_f64(box[1])
    candidates, p = settings["candidates"], low.numel()
    lattice = designs.candidate_lattice(lattice_steps, p, candidates)
    kind = designs.candidate_design(p, lattice, low, high, candidates)
    sizes = designs.adaptive_sizes(p, candidates, targets) if kind == "adaptive" else None
    refinement = adaptive.Refinement(
        adaptive.support_box(low, high, lattice), list(settings["levels"]), sizes, runtime.derived_seed(seed, "refine")
    )
    return Design(kind, lattice, refinement)


def shared_candidates(
    box: tuple[Any, Any], lattice: Sequence[float | None], candidates: Mapping[str, Any], seed: int
) -> Candidates:
    """The shared design of a box on the candidates' lattice, its seed derived from the training seed."""
    return Candidates(
        *designs.make_candidates(box[0], box[1], lattice, candidates, runtime.derived_seed(seed, "candidates"))
    )


def analyse_block(
    design: Design, shared: Candidates, score_fn: ScoreFn, truths: torch.Tensor, cases: Sequence[int]
) -> dict[str, Any]:
    """A block of cases refined (adaptive design: adaptive.refine_block, `shared` its coarse pass) or
    scored on the shared candidates, every target's summaries as tensors.

    Returns the cases' points and log measure (a fixed design's shared ones), every target's
    scores (B, n + 1) (the truth's last), summaries (edge_mass and disagreement NaN for a fixed
    design: it has no refined box) and the points each case evaluated.
    """
    if design.kind == "adaptive":
        return adaptive.refine_block(score_fn, shared, truths, cases, design.refinement)
    # Each case's candidates followed by its truth, in one call.
    rows = score_fn(torch.cat([shared.points.expand(truths.shape[0], -1, -1), truths[:, None]], dim=1))
    summaries = {}
    for target, values in rows.items():
        hpd.check_scores(values[:, :-1], values[:, -1])
        summary = hpd.summarise_block(
            values[:, :-1], shared.log_measure, shared.points, values[:, -1], design.refinement.levels
        )
        summary["edge_mass"] = summary["disagreement"] = values.new_full((truths.shape[0],), math.nan)
        summaries[target] = summary
    return {
        "points": shared.points,
        "log_measure": shared.log_measure,
        "scores": dict(rows),
        "summaries": summaries,
        "evaluated": shared.points.shape[0],
    }


def case_bytes(candidates: int, p: int, targets: int, levels: int, components: int = 0, draws: int = 0) -> int:
    """About the bytes one case's refinement or summary holds at once: its points, weights and scores,
    the proposals' densities, the summaries' sorted copies and region flags (one byte a level),
    and the refined passes' unit draws."""
    per_point = p + 1 + 2 * targets + 3 * components + 14
    return 8 * (candidates * per_point + draws * p) + candidates * levels


def design_case_bytes(design: Design, candidates: int, p: int, targets: int) -> int:
    """case_bytes of a case on this design: refined (adaptive) or scored on `candidates` shared points,
    its truth included."""
    levels, sizes = len(design.refinement.levels), design.refinement.sizes
    if sizes is None:
        return case_bytes(candidates + 1, p, targets, levels)
    return case_bytes(sizes["total"] + 1, p, targets, levels, targets * len(sizes["passes"]), sum(sizes["passes"]))


def blocks_of_cases(
    design: Design,
    shared: Candidates,
    scoring: Scoring,
    truths: torch.Tensor,
    targets: int,
    progress: Callable[[int], None] = lambda case: None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every case through analyse_block, as many at once as `scoring.block_bytes` allows for `targets`
    targets: yields each block's first case and its results, on `scoring.device`; `progress(case)`
    is told each block's first case before its work."""
    cases, p = truths.shape
    block = case_scores.cases_per_block(
        cases, design_case_bytes(design, shared.points.shape[0], p, targets), scoring.block_bytes
    )
    shared = shared.to(scoring.device)
    for start in range(0, cases, block):
        stop = min(cases, start + block)
        progress(start)
        index = torch.arange(start, stop)
        result = analyse_block(
            design,
            shared,
            lambda points: scoring.scores(index, points),
            truths[start:stop].to(scoring.device),
            index.tolist(),
        )
        yield start, result


# ---------------------------------------------------------------- the scorings of the kit's targets


@contextlib.contextmanager
def network_precision(precision, device):
    """The arithmetic of the analysis' network calls: float32, TF32 matrix products (CUDA) or bfloat16 autocast."""
    if precision == "bfloat16":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    elif precision == "tf32" and device.type == "cuda":
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    else:
        yield


def learned_scoring(model, device, prior, observations, targets, settings, counted, policy=None):
    """Scoring of the learned targets: the model's ensemble score of each case's observations
    (ratio), plus the log prior (posterior); `counted` (an case_scores.Evaluations) counts the calls.
    `policy` (an case_scores.CallPolicy) defaults to the device's own."""
    input_width = observations.shape[2] + len(prior.lattice_steps)
    policy = policy or case_scores.call_policy(
        device.type, settings["chunk_rows"], case_scores.network_row_bytes(model, input_width)
    )
    on_device, precision = observations.to(device), settings.get("precision", "float32")

    # The model is the logit function itself: the logits of any floating dtype (bfloat16 under
    # autocast) are summed in float64 (one conversion fewer after each network call).
    with network_precision(precision, device):
        column_rows = case_scores.accepts_column_rows(model, input_width, device)

    def scores(cases, points):
        with network_precision(precision, device):
            ratio = case_scores.ensemble_scores(
                model, on_device[cases.to(device)], points, policy.rows_per_call, counted, column_rows
            )
        values = {"ratio": ratio}
        if "posterior" in targets:
            values["posterior"] = ratio + torch.as_tensor(prior.log_prob(points), device=device)
        return {t: values[t] for t in targets}

    return Scoring(scores, device, policy.block_bytes)


def exact_scoring(log_likelihood, observations, device, chunk_rows, counted=None):
    """Scoring of the exact target: each case's summed log-likelihood on `device`; `counted`
    (an case_scores.Evaluations) counts the likelihood terms."""
    policy = case_scores.call_policy(device.type, chunk_rows)
    on_device = observations.to(device)

    def scores(cases, points):
        if counted is not None:
            terms = points.shape[0] * points.shape[1] * observations.shape[1]
            counted.add(terms, terms)
        return {
            "exact": case_scores.exact_scores(log_likelihood, on_device[cases.to(device)], points, policy.rows_per_call)
        }

    return Scoring(scores, device, policy.block_bytes)
