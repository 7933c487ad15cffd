"""Rounds: a kit study's simulations spent where one observation's posterior has its mass.

A training section `rounds = {"observation": "x_o.npy"}` (count 3, truncation 1e-3 by default)
turns each cohort member's training into `count` rounds for the observation x_o. Round 1 is
the member itself (its key is the amortized model's). Round r + 1 is the member plus
`round`, `box` (the box where round r's posterior for x_o keeps all but `truncation` of its
mass), `previous` (round r's model key) and `observation` (x_o's digest, not its path): an
ordinary member whose prior is the member's prior cut to the box (`cut_prior`) and whose
problem is seen inside the box (`BoxProblem`), so the store, resume, `jobs` and `ddp` treat
a round as any other training; with `warm` (the default) its training starts from round r's
network, re-standardised on its own data, and with `proposal` (the fit of round r's
posterior, by default) half its train and validation θ are drawn near that posterior
(`PosteriorProposal`). The run folder records the last round's member: `restore`, `infer`
and the analysis work on the last round inside the final box. docs/rounds.md says when
rounds pay, what they cost and how the rule was chosen.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import numpy as np
import torch

import fingerprint
import infer
import networks
import posterior
import priors
import runtime
import sampler
from settings import SettingsError, integer, known_keys, number, require
from store import NnpdError

__all__ = [
    "ROUND_KEYS",
    "RoundsError",
    "rounds_settings",
    "read_observation",
    "observation_digest",
    "base_member",
    "round_recipe",
    "with_earlier",
    "warm_start",
    "BoxProblem",
    "CutPrior",
    "cut_prior",
    "PosteriorProposal",
    "proposal",
    "follows_a_proposal",
    "snap_to_lattice",
    "posterior_box",
    "edge_mass",
    "edge_warnings",
    "next_round",
    "outside_warning",
]

ROUND_KEYS = ("round", "box", "previous", "observation", "reuse", "warm", "proposal", "history")
SETTINGS_KEYS = ("count", "observation", "truncation", "reuse", "warm", "proposal")
WHERE = 'docs/rounds.md, "Settings"'
MAX_ROUNDS = 20
DEFAULT_COUNT = 3  # rounds when `count` is left out (docs/rounds.md, "When rounds pay")
BOX_DRAWS = 20_000  # posterior draws the box's quantiles are taken from
PADDING = 0.1  # the box is widened by this share of its width on each side
MASS_DRAWS = 200_000  # prior draws that estimate a custom prior's mass in the box
MIN_ACCEPTANCE = 1e-4  # a custom prior putting less of its mass in the box is refused
SAMPLING_BUDGET = 100  # prior draws allowed per cut-prior draw asked, over the expected
EDGE_BAND = 0.02  # a band along a cut face, as a share of the box's width: mass there is a lost tail
SHARE_DRAWS = 20_000  # prior draws that estimate the share of the prior's mass in a round's box
PROPOSALS = {
    "posterior": "half a round's train and validation draws follow the previous round's posterior",
    "prior": "a round draws every simulation from its prior, the member's cut to the box",
}
PROPOSAL_PRIOR_SHARE = 0.5  # of a posterior proposal's draws, from the cut prior: the whole box stays trained
SPREAD_MARGIN = math.sqrt(2)  # posterior sds by which the proposal's draws typically lie beyond the posterior's


class RoundsError(NnpdError, ValueError):
    """A round that cannot be made as asked; the message says why and what to change."""


# ---------------------------------------------------------------- settings and the observation


def rounds_settings(settings: dict[str, Any]) -> dict[str, Any] | None:
    """The checked `rounds` section with its defaults (count 3, truncation 1e-3, reuse, warm, the posterior
    proposal), or None without one."""
    section = settings.get("rounds")
    if section is None:
        return None
    known_keys(section, SETTINGS_KEYS, "rounds")
    count = integer(section.get("count", DEFAULT_COUNT), "rounds.count", 1, MAX_ROUNDS)
    epsilon = number(section.get("truncation", 1e-3), "rounds.truncation", 0.0, 0.5, low_open=True)
    path = require(section, "observation", "rounds")
    if not isinstance(path, str):
        raise SettingsError(
            f"rounds.observation: expected the path of a .npy file saved with numpy.save, got {path!r} ({WHERE})"
        )
    choices = {
        "reuse": "a round also trains on the earlier rounds' simulations inside its box",
        "warm": "a round's training starts from the previous round's weights",
    }
    for key, meaning in choices.items():
        if not isinstance(section.get(key, True), bool):
            raise SettingsError(f"rounds.{key}: True ({meaning}) or False, got {section[key]!r} ({WHERE})")
    if section.get("proposal", "posterior") not in PROPOSALS:
        meanings = "; ".join(f"{name!r}: {meaning}" for name, meaning in PROPOSALS.items())
        raise SettingsError(f"rounds.proposal: one of {meanings}; got {section['proposal']!r} ({WHERE})")
    return {
        "count": count,
        "observation": path,
        "truncation": epsilon,
        "reuse": section.get("reuse", True),
        "warm": section.get("warm", True),
        "proposal": section.get("proposal", "posterior"),
    }


def read_observation(path: str, dimension: int) -> np.ndarray:
    """x_o as float64 (m, d), read as `infer` reads files (a regular .npy file, size-capped), or a SettingsError."""
    try:
        array = infer.read_array(path, "rounds.observation")
    except infer.InferError as error:
        raise SettingsError(f"{error} ({WHERE})") from None
    x = np.ascontiguousarray(array, dtype=np.float64)
    x = x[None] if x.ndim == 1 else x
    if x.ndim != 2 or x.shape[1] != dimension or not len(x):
        raise SettingsError(
            f"rounds.observation {path}: shape {array.shape}; expected ({dimension},) for one "
            f"observation or (m, {dimension}) for m of them ({WHERE})"
        )
    return x


def observation_digest(x: Any) -> str:
    """The observation's content digest (shape and float64 values), which enters the rounds' keys."""
    array = np.ascontiguousarray(np.asarray(x, dtype=np.float64))
    array = array[None] if array.ndim == 1 else array
    return hashlib.sha256(repr(array.shape).encode() + array.tobytes()).hexdigest()


def base_member(member: dict[str, Any]) -> dict[str, Any]:
    """The cohort member a round belongs to: the member without its round's keys."""
    return {key: value for key, value in member.items() if key not in ROUND_KEYS}


def round_recipe(member: dict[str, Any]) -> dict[str, Any]:
    """What a later round's keys add to its member's: the round, box, previous model, observation and the
    source of the cut; empty for round 1, whose keys are the amortized model's."""
    if "box" not in member:
        return {}
    recipe = {key: member[key] for key in ("round", "box", "previous", "observation")}
    for key in ("reuse", "warm", "proposal"):  # only where set: the keys of rounds without them stay as they were
        if key in member:
            recipe[key] = member[key]
    sources = (BoxProblem, CutPrior, cut_prior) + ((PosteriorProposal, proposal) if "proposal" in member else ())
    return {"rounds": {**recipe, "source": fingerprint.source_fingerprint(*sources)}}


def with_earlier(study: Any, member: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A round's fresh simulations, with the previous round's that fall inside its box appended per split.

    The previous round's simulations are draws of its prior, cut to a box that holds this
    one, so those inside this box are draws of this round's prior too. Its data (which
    holds the rounds before it that fell in its box) were loaded when its model was.
    """
    key = member.get("reuse")
    if key is None:
        return arrays
    earlier = study.round_data.get(key)
    if earlier is None:
        raise RoundsError(
            f"round {member['round']}: the previous round's simulations (data {key}) are not loaded; "
            "train the rounds from round 1 with `nnpd train`, which loads each round in turn"
        )
    low, high = (np.asarray(bound) for bound in member["box"])
    arrays = dict(arrays)
    for split in ("train", "validation", "test"):
        if f"{split}_x" in arrays and f"{split}_theta" in earlier:
            theta = earlier[f"{split}_theta"]
            keep = ((theta >= low) & (theta <= high)).all(axis=1)
            arrays[f"{split}_x"] = np.concatenate([arrays[f"{split}_x"], earlier[f"{split}_x"][keep]])
            arrays[f"{split}_theta"] = np.concatenate([arrays[f"{split}_theta"], theta[keep]])
    return arrays


# ---------------------------------------------------------------- the box and the cut prior


class BoxProblem:
    """A study's problem seen inside a round's box: `low`, `high` and each parameter's bounds are the box's;
    everything else (names, simulator, likelihood, lattice) is the problem's."""

    def __init__(self, problem: Any, box: Any) -> None:
        self._problem = problem
        self.low, self.high = (torch.as_tensor(bound, dtype=torch.float64) for bound in box)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._problem, name)

    def parameter(self, name: str) -> dict[str, Any]:
        """The parameter's hyper-parameters, with the box's bounds."""
        j = self._problem.names.index(name)
        return {**self._problem.parameter(name), "low": float(self.low[j]), "high": float(self.high[j])}

    def describe(self) -> Any:
        """The problem's description with the box."""
        return {**self._problem.describe(), "box": [self.low.tolist(), self.high.tolist()]}


def inside(theta: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Whether each row of theta (..., p) lies in the box [low, high]."""
    return ((theta >= low) & (theta <= high)).all(dim=-1)


class CutPrior:
    """A study's own prior object cut to a box: rejection from it, log density renormalised by the box's
    prior mass (estimated from MASS_DRAWS seeded draws)."""

    def __init__(self, prior: Any, box: Any, seed: int) -> None:
        self.prior = prior
        self.low, self.high = (torch.as_tensor(bound, dtype=torch.float64) for bound in box)
        self.lattice_steps = list(prior.lattice_steps)
        draws = prior.sample(MASS_DRAWS, runtime.seeded_generator(seed, "rounds", "box mass"))
        self.mass = float(inside(draws, self.low, self.high).double().mean())
        if self.mass < MIN_ACCEPTANCE:
            raise RoundsError(
                f"the prior puts {self.mass:.2g} of its mass in the round's box, too little to draw "
                "from by rejection; lower rounds.truncation for a wider box (docs/rounds.md)"
            )

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n draws (n, p) of the prior inside the box, by rejection within a bounded budget."""
        kept: list[torch.Tensor] = []
        found, drawn, budget = 0, 0, SAMPLING_BUDGET * n / self.mass + 1000
        while found < n:
            if drawn > budget:
                raise RoundsError(
                    f"{drawn:,} prior draws gave fewer than {n:,} inside the round's box; lower "
                    "rounds.truncation for a wider box (docs/rounds.md)"
                )
            batch = self.prior.sample(max(64, int(1.2 * (n - found) / self.mass)), generator)
            drawn += len(batch)
            kept.append(batch[inside(batch, self.low, self.high)])
            found += len(kept[-1])
        return torch.cat(kept)[:n]

    def log_prob(self, theta: Any) -> torch.Tensor:
        """The prior's log density renormalised to the box; −inf outside it."""
        theta = torch.as_tensor(theta, dtype=torch.float64)
        log_p = self.prior.log_prob(theta) - math.log(self.mass)
        return torch.where(
            inside(theta, self.low.to(theta.device), self.high.to(theta.device)),
            log_p,
            torch.full_like(log_p, -math.inf),
        )

    def describe(self) -> Any:
        """The prior's description, the box and its mass there."""
        return {"cut": self.prior.describe(), "box": [self.low.tolist(), self.high.tolist()], "mass": self.mass}


def cut_prior(study: Any, member: dict[str, Any]) -> Any:
    """A round's prior: the member's prior cut to the round's box.

    A bundled family is rebuilt on the box (`priors.make_prior` on a BoxProblem): each
    coordinate's truncated law is exact, drawn by its inverse CDF and normalised on the box.
    A study's own prior object is cut by rejection (CutPrior).
    """
    base, boxed = base_member(member), BoxProblem(study.problem(), member["box"])
    name = member["prior"]
    if name in study.custom_priors and name not in study.settings["priors"]:
        return CutPrior(study.prior(base), member["box"], study.settings["seed"])
    return priors.make_prior(boxed, study.settings["priors"][name], f"priors.{name}")


class PosteriorProposal:
    """Where a round with the posterior proposal draws the θ of its train and validation simulations.

    PROPOSAL_PRIOR_SHARE of them come from the round's prior (the member's cut to the box),
    the rest from a Gaussian mixture fitted to the previous round's posterior for x_o (one
    component per mode, `mixture_fit`), its sds widened by `proposal_spread`, cut to the box.
    Any law of θ trains a valid ratio (the classifier learns p(x | θ) over a function of x),
    so the posterior stays ratio × cut prior; the prior's share keeps the whole box trained,
    where the analysis draws its truths.
    """

    def __init__(self, prior: Any, fit: dict[str, Any], box: Any) -> None:
        self.prior = prior
        self.shares = torch.tensor(fit["shares"], dtype=torch.float64)
        self.means = torch.tensor(fit["means"], dtype=torch.float64)
        covs = torch.tensor(fit["covs"], dtype=torch.float64) * proposal_spread(self.means.shape[1]) ** 2
        self.scales = torch.stack([cholesky_or_diagonal(cov) for cov in covs])
        self.low, self.high = (torch.as_tensor(bound, dtype=torch.float64) for bound in box)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n draws (n, p) in the box, shuffled: the prior's share, then the mixture's by rejection (within
        SAMPLING_BUDGET draws per row asked, the prior filling in where the mixture hardly meets the box)."""
        from_prior = round(PROPOSAL_PRIOR_SHARE * n)
        parts = [self.prior.sample(from_prior, generator).to(torch.float64)] if from_prior else []
        needed, drawn = n - from_prior, 0
        while needed > 0 and drawn <= SAMPLING_BUDGET * n:
            count = 2 * needed + 64
            component = torch.multinomial(self.shares, count, replacement=True, generator=generator)
            z = torch.randn(count, self.means.shape[1], 1, generator=generator, dtype=torch.float64)
            batch = self.means[component] + (self.scales[component] @ z)[:, :, 0]
            drawn += len(batch)
            parts.append(batch[inside(batch, self.low, self.high)][:needed])
            needed -= len(parts[-1])
        if needed > 0:
            parts.append(self.prior.sample(needed, generator).to(torch.float64))
        return torch.cat(parts)[torch.randperm(n, generator=generator)]


def proposal_spread(p: int) -> float:
    """The factor s widening a fitted component's sds in p parameters, 1 + SPREAD_MARGIN / √p: a Gaussian's
    draws lie about √p sds from its mean, so the widened one's lie SPREAD_MARGIN sds beyond the posterior's.
    Twice the fit in 2 parameters; in 10, 1.45: a fixed factor wide enough for 2 parameters would put
    a 10-parameter proposal's draws almost all outside the posterior's shell (docs/rounds.md)."""
    return 1 + SPREAD_MARGIN / math.sqrt(p)


def cholesky_or_diagonal(cov: torch.Tensor) -> torch.Tensor:
    """A lower Cholesky factor of cov, or the diagonal of its sds where cov is singular (a collapsed fit)."""
    factor, info = torch.linalg.cholesky_ex(cov)
    return factor if int(info) == 0 else torch.diag(cov.diagonal().clamp(min=0).sqrt())


def proposal(prior: Any, member: dict[str, Any]) -> PosteriorProposal | None:
    """The round's posterior proposal over its prior, or None (round 1, or a round drawing from its prior)."""
    return PosteriorProposal(prior, member["proposal"], member["box"]) if "proposal" in member else None


def mixture_fit(points: torch.Tensor, masses: torch.Tensor) -> dict[str, Any]:
    """A Gaussian mixture fitted to the weighted points, as JSON lists of shares, means and covariances:
    the posterior sampler's `select_mixture`, seeded, so one component per mode where more pay by BIC
    (its ridge keeps a collapsed fit's covariances invertible)."""
    mixture = sampler.select_mixture(points, masses / masses.sum(), torch.Generator().manual_seed(0))
    covs = mixture.factors @ mixture.factors.transpose(1, 2)
    return {"shares": mixture.log_shares.exp().tolist(), "means": mixture.means.tolist(), "covs": covs.tolist()}


# ---------------------------------------------------------------- the rule: where the posterior keeps its mass


def snap_to_lattice(problem: Any, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds moved outward onto each lattice parameter's points, so a cut lattice keeps the prior's points."""
    low, high = low.clone(), high.clone()
    for j, name in enumerate(problem.names):
        step = problem.parameter(name)["grid_step"]
        if step is not None:
            origin = float(problem.low[j])
            low[j] = origin + math.floor((float(low[j]) - origin) / step + 1e-9) * step
            high[j] = min(origin + math.ceil((float(high[j]) - origin) / step - 1e-9) * step, float(problem.high[j]))
    return low, high


def weighted_quantiles(points: torch.Tensor, masses: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per coordinate, the q and 1 − q quantiles of weighted points (a posterior's candidates)."""
    bounds = []
    for column in points.T:
        order = torch.argsort(column)
        cumulative = torch.cumsum(masses[order], 0) / masses.sum()
        pick = torch.searchsorted(cumulative, torch.tensor([q, 1 - q], dtype=cumulative.dtype))
        bounds.append(column[order][pick.clamp(max=len(column) - 1)])
    low, high = torch.stack(bounds).T
    return low, high


def posterior_draws(post: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior's draws with equal weights, or its weighted candidates when it cannot be sampled."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draws = post.sample(BOX_DRAWS, seed=0)
        return draws, torch.full((len(draws),), 1.0 / len(draws), dtype=torch.float64)
    except posterior.PosteriorError:  # too few effective candidates to sample: their weights still place the mass
        return post.points, post.masses


def posterior_box(
    study: Any, member: dict[str, Any], state: dict[str, Any], x: np.ndarray, epsilon: float
) -> dict[str, Any]:
    """The next round's box from this round's posterior for x: per parameter the ε/(2p) and 1 − ε/(2p)
    quantiles (the box then keeps at least 1 − ε of the mass), padded by PADDING of their span, within
    the round's own box, on the lattice; with the mass this round's posterior puts near its own cut faces,
    and its draws' Gaussian fit (the next round's posterior proposal)."""
    problem = study.problem(member)
    model = study.build_model(member)
    model.load_state_dict(state)
    post = study.posterior(member, model.eval(), {}, x)
    points, masses = posterior_draws(post)
    low, high = weighted_quantiles(points, masses, epsilon / (2 * problem.parameter_count))
    full = study.problem()
    pad = PADDING * (high - low) + 1e-6 * (full.high - full.low)
    low, high = torch.maximum(low - pad, problem.low), torch.minimum(high + pad, problem.high)
    low, high = snap_to_lattice(full, low, high)
    return {
        "box": [low.tolist(), high.tolist()],
        "edge_mass": edge_mass(problem, full, points, masses),
        "fit": mixture_fit(points, masses),
    }


def edge_mass(problem: Any, full: Any, points: torch.Tensor, masses: torch.Tensor) -> list[float]:
    """Per parameter, the posterior mass within one edge band (EDGE_BAND of the box's width) of a face the
    round's box cut from the prior's; 0 where neither face was cut. Above ε, the cut lost mass."""
    band = EDGE_BAND * (problem.high - problem.low)
    shares = []
    for j in range(problem.parameter_count):
        near = torch.zeros(len(points), dtype=torch.bool)
        if float(problem.low[j]) > float(full.low[j]):
            near |= points[:, j] <= problem.low[j] + band[j]
        if float(problem.high[j]) < float(full.high[j]):
            near |= points[:, j] >= problem.high[j] - band[j]
        shares.append(float(masses[near].sum() / masses.sum()))
    return shares


# ---------------------------------------------------------------- one round after another


def next_round(study: Any, member: dict[str, Any], tools: Any) -> dict[str, Any] | None:
    """The member after `member`: the next round's, or the last round's again with its truncation check;
    None once that is recorded (or without rounds). Each round's model is got or trained first through
    `tools.trained()`; `tools` is the framework's jobs.RoundTools."""
    section = rounds_settings(study.settings)
    if section is None or section["count"] == 1:
        return None
    this, rows = member.get("round", 1), list(member.get("history") or [round_row(study, member)])
    if "edge_mass" in rows[-1]:  # the last round, checked: the framework records it
        return None
    if this == 1:
        tools.log(round_line(section, rows[0]))
    data, model = tools.trained()
    rows[-1] = {**rows[-1], **simulations_used(study, data)}
    x = read_observation(section["observation"], study.problem().dimension)
    digest = observation_digest(x)
    found = shared_box(study, member, model, x, digest, section["truncation"], tools)
    rows[-1] = {**rows[-1], "edge_mass": found["edge_mass"]}
    for line in edge_warnings(study.problem().names, rows[-1], section["truncation"]):
        warnings.warn(line, stacklevel=2)
        tools.log(f"warning: {line}")
    if this >= section["count"]:
        return {**member, "history": rows}
    following = {
        **base_member(member),
        "round": this + 1,
        "box": found["box"],
        "previous": found["model"],
        "observation": digest,
    }
    if section["proposal"] == "posterior" and follows_a_proposal(study, member):
        following["proposal"] = found["fit"]
    if section["warm"]:
        following["warm"] = True
        study.round_states[found["model"]] = shared_state(model, tools.rt)
    if section["reuse"] and data is not None:
        following["reuse"] = data.key
        splits = [name[: -len("_x")] for name in data.metadata["rows"] if name.endswith("_x")]
        study.round_data[data.key] = {
            name: data.array(name) for split in splits for name in (f"{split}_x", f"{split}_theta")
        }
    following["history"] = rows + [round_row(study, following)]
    tools.log(round_line(section, following["history"][-1]))
    return following


def follows_a_proposal(study: Any, member: dict[str, Any]) -> bool:
    """Whether a round can draw from the posterior proposal: joint pairs re-paired in every batch (pairing
    "batch") of continuous parameters (a Gaussian's draws are not on a lattice). Rounds refuse a bank at plan."""
    continuous = all(step is None for step in study.prior(base_member(member)).lattice_steps)
    return continuous and study.settings["data"].get("pairing", "batch") == "batch"


def shared_box(
    study: Any, member: dict[str, Any], model: Any, x: np.ndarray, digest: str, epsilon: float, tools: Any
) -> dict[str, Any]:
    """The next box, cached in the store by the model, observation and ε (a rerun computes nothing); under
    ddp rank 0 computes it and every rank gets its copy (only rank 0 holds the model artifact)."""

    def compute() -> dict[str, Any]:
        recipe = {
            "model": model.key,
            "observation": digest,
            "truncation": epsilon,
            "member": member,
            "source": fingerprint.source_fingerprint(posterior_box, mixture_fit, posterior, sampler),
        }

        def build(writer: Any) -> None:
            writer.json("box", posterior_box(study, member, model.state_dict(), x, epsilon))

        artifact = tools.store.get("round-box", recipe, build=build)
        tools.used.add(artifact.key)
        return {**artifact.json("box"), "model": model.key}

    if tools.rt.ddp:
        return runtime.broadcast_object(tools.rt, compute() if tools.rt.is_main else None)
    return compute()


def shared_state(model: Any, rt: Any) -> dict[str, torch.Tensor] | None:
    """The round's trained weights on every rank (under ddp only rank 0 holds the model artifact)."""
    state = None if model is None else model.state_dict()
    return runtime.broadcast_object(rt, state) if rt.ddp else state


def warm_start(study: Any, member: dict[str, Any], model: torch.nn.Module) -> None:
    """Start a `warm` round's network from the previous round's function: its weights, then the input
    standardisation this round fitted on its own data, folded into the first layer
    (networks.restandardize). The previous logit is already the log ratio up to a constant inside the
    new box, which the training refines; standardised on the box, a posterior much narrower than the
    prior spans whole units of the network's input, where a smooth activation can follow it
    (docs/rounds.md, "Choices, and what was measured")."""
    if not member.get("warm"):
        return
    state = study.round_states.get(member["previous"])
    if state is None:
        raise RoundsError(
            f"round {member['round']}: the previous round's weights (model {member['previous']}) are not "
            "loaded; train the rounds from round 1 with `nnpd train`, which loads each round in turn"
        )
    fitted = (model.shift.clone(), model.scale.clone()) if isinstance(model, networks.Standardized) else None
    model.load_state_dict(state)
    if fitted is not None:
        networks.restandardize(model, *fitted)


def round_row(study: Any, member: dict[str, Any]) -> dict[str, Any]:
    """What the record keeps of a round: its box, the box's share of the prior's volume and mass, its
    simulations, and whether half its train and validation draws followed the previous posterior."""
    full, problem = study.problem(), study.problem(member)
    draws = study.prior(base_member(member)).sample(
        SHARE_DRAWS, runtime.seeded_generator(study.settings["seed"], "rounds", "share")
    )
    data = study.settings["data"]
    return {
        "round": member.get("round", 1),
        "box": [problem.low.tolist(), problem.high.tolist()],
        "volume": float(torch.prod((problem.high - problem.low) / (full.high - full.low))),
        "prior_mass": float(inside(draws, problem.low, problem.high).double().mean()),
        "simulations": int(sum(data[split] for split in ("train", "validation", "test"))),
        "proposal": "posterior" if "proposal" in member else "prior",
    }


def simulations_used(study: Any, data: Any) -> dict[str, int]:
    """The simulations a round trained on (its `data` rows), and how many of them an earlier round made."""
    fresh = sum(study.settings["data"][split] for split in ("train", "validation", "test"))
    used = sum(count for name, count in ((data.metadata or {}).get("rows") or {}).items() if name.endswith("_x"))
    return {"simulations": used or fresh, "reused": max(0, used - fresh)}


def round_line(section: dict[str, Any], row: dict[str, Any]) -> str:
    """The progress line that starts a round."""
    near = row.get("proposal") == "posterior"
    return (
        f"round {row['round']} of {section['count']}: box {100 * row['volume']:.3g}% of the prior's volume, "
        f"{100 * row['prior_mass']:.3g}% of its mass; {row['simulations']:,} simulations"
        + (f"; half of train and validation near round {row['round'] - 1}'s posterior" if near else "")
    )


def edge_warnings(names: list[str], row: dict[str, Any], epsilon: float) -> list[str]:
    """One line per parameter whose posterior mass near a cut face of the round's box is above ε."""
    return [
        f"round {row['round']}: the posterior puts {mass:.2g} of its mass within {EDGE_BAND:.0%} of the box's "
        f"width of a cut face of {name!r} (above rounds.truncation {epsilon:g}): the box may have cut its tail; "
        "lower rounds.truncation for a wider box (docs/rounds.md)"
        for name, mass in zip(names, row.get("edge_mass", ()))
        if mass > epsilon
    ]


def outside_warning(member: dict[str, Any], observations: Any) -> str | None:
    """One line when a posterior of the rounds' model is asked for an observation other than the rounds'."""
    if "observation" not in member or observation_digest(observations) == member["observation"]:
        return None
    return (
        "this model was trained in rounds for another observation, inside a box around that one's "
        "posterior: this observation's posterior may extend beyond the box, where it is cut to zero "
        "(docs/rounds.md)"
    )
