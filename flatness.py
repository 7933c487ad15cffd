"""Whether a learned posterior is nearly flat against its prior, and one line saying why.

The analysis' `posterior` metric (nre_analysis.py), a posterior for one observation (posterior.py)
and `infer` judge with the same rule, so a user sees the same warning in each.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FLAT_INFORMATION",
    "FLAT_SD_SHARE",
    "HIGH_AUC",
    "PRIOR_DRAWS",
    "flat_cause",
    "flatness_report",
    "information_per_parameter",
    "joint_share",
    "prior_sds",
    "sd_shares",
]

# A learned posterior is nearly flat when it keeps nearly the prior's spread as a whole: the geometric
# mean of its sds over the prior's (the p-th root of its sd ellipsoid's volume share) above
# FLAT_SD_SHARE. Measured cases: a prior-like posterior has 1.0 (0.95-1.0 from an untrained model);
# informative ones lie well below 0.85: the exact posteriors of examples/ (decay 0.37-0.46, pulse up to
# 0.29, weibull's six lifetimes 0.58-0.75, up to 0.97 in one parameter at some truths) and a damped
# oscillator seen at 20 noisy times (exact 0.32-0.36, a learned one about 1.5 times that). A single
# wide parameter beside informative ones is not flat: the observations say little about it, which
# its `sd_share` shows. Whatever the model, a flat posterior is worth a line; its validation AUC says
# which cause is likely. Below HIGH_AUC the network barely tells joint from marginal pairs, so it has
# learned little; at or above it the model discriminates, so these observations say little (or the
# candidates missed the posterior: the resolution warning says so).
FLAT_SD_SHARE = 0.85
# ... and gains little information over the prior: its Kullback-Leibler divergence from the prior,
# per parameter, below FLAT_INFORMATION nats. The sds alone call a posterior of wide thin arcs or of
# separated narrow modes flat, though it rules out most of the box: a thin ring around the box's
# centre (tests/test_flatness.py) has sds 0.86 of the prior's and 1.2 nats per parameter; exact
# posteriors of the posterior-quality bench's ring hold 1.7-2.4. A prior-like posterior holds 0, a
# normal one with sds 0.85 of a uniform prior's about 0 (−0.18 − log 0.85 per parameter) and the
# bundled study's at sd shares 0.35, 0.51 and 0.65 hold 0.88, 0.49 and 0.27: the bound changes
# nothing for unimodal posteriors, which the sds judge.
FLAT_INFORMATION = 0.5
HIGH_AUC = 0.75
PRIOR_DRAWS = 20_000  # draws of the prior's sds: a relative error of about 0.5%


def prior_sds(prior, parameter_count):
    """The prior's marginal sds (p,), from PRIOR_DRAWS draws of a fixed stream."""
    draws = prior.sample(PRIOR_DRAWS, torch.Generator().manual_seed(0))
    return torch.as_tensor(draws, dtype=torch.float64).reshape(-1, parameter_count).std(0)


def flat_cause(auc):
    """Why a posterior is likely flat, from the model's validation AUC."""
    if auc is None:
        return "the model's validation AUC is unknown"
    if auc < HIGH_AUC:
        return (
            f"the model barely tells joint from marginal pairs (validation AUC {auc:.2f}, below {HIGH_AUC}), "
            "so it has learned little: train longer or on more data"
        )
    return (
        f"the model tells joint from marginal pairs well (validation AUC {auc:.2f}), so the observations say "
        "little about them (or the candidates missed the posterior)"
    )


def sd_shares(posterior_sds, prior_sd):
    """Each parameter's posterior sd over its prior's (None where the prior's is 0, or unknown: None)."""
    if prior_sd is None:  # a posterior built without its prior's sds (posterior.from_scores)
        return [None] * len(posterior_sds)
    return [float(a) / float(b) if float(b) > 0 else None for a, b in zip(posterior_sds, prior_sd)]


def joint_share(shares):
    """The geometric mean of the sd shares (None when one is unknown or 0): the posterior's spread as a whole."""
    if not shares or any(share is None or share <= 0 for share in shares):
        return None
    return math.exp(sum(math.log(share) for share in shares) / len(shares))


def information_per_parameter(masses, log_measure, log_prior, parameter_count):
    """The posterior's Kullback-Leibler divergence from the prior over its candidates, in nats per parameter.

    `masses` (n,) are the posterior's on the candidates; the prior's are their measure times its density
    (`log_measure`, `log_prior`, (n,)), normalised over the same candidates.
    """
    log_q = torch.as_tensor(log_measure, dtype=torch.float64) + torch.as_tensor(log_prior, dtype=torch.float64)
    log_q = log_q - torch.logsumexp(log_q, 0)
    held = masses > 0
    divergence = float((masses[held] * (torch.log(masses[held]) - log_q[held])).sum())
    return max(divergence, 0.0) / parameter_count


def flatness_report(names, posterior_sds, prior_sd, auc, information=None):
    """Whether a posterior is nearly flat (see FLAT_SD_SHARE and FLAT_INFORMATION): its sd shares, the joint
    one, its information per parameter, and one line or None.

    `parameters` names those whose own share is above FLAT_SD_SHARE when the whole posterior is flat.
    `information` None (unknown) leaves the sds to decide alone.
    """
    shares = sd_shares(posterior_sds, prior_sd)
    joint = joint_share(shares)
    informative = information is not None and information >= FLAT_INFORMATION
    flat = (
        []
        if joint is None or joint <= FLAT_SD_SHARE or informative
        else [name for name, share in zip(names, shares) if share > FLAT_SD_SHARE]
    )
    warning = None
    if flat:
        warning = (
            f"the posterior is nearly flat in {', '.join(flat)}: its sds are {joint:.2f} of the prior's "
            f"(geometric mean, above {FLAT_SD_SHARE:g}); {flat_cause(auc)}"
        )
    return {
        "flat": bool(flat),
        "parameters": flat,
        "sd_share": shares,
        "joint_sd_share": joint,
        "information": information,
        "validation_auc": auc,
        "warning": warning,
    }
