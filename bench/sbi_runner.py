"""sbi's side of the benches: amortized NRE on given simulations, or sequential inference for one x_o.

Runs under bench/.venv-sbi's python only (nnpd's environment never imports sbi):

    bench/.venv-sbi/bin/python bench/sbi_runner.py FOLDER METHOD

Amortized (bench_posterior_quality.py), METHOD NRE_A or NRE_C: FOLDER holds theta.npy (n, p),
x.npy (n, d), observations.npy (m, d) and job.json ({"prior": ..., "samples": n, "seed": s}).
Each method keeps sbi's defaults: `train()` as is, `build_posterior()` as is (its default
MCMC sampler). Writes METHOD-samples.npy (m, n, p) and METHOD.json with the CPU seconds of
training and of each observation's sampling.

Sequential (bench_rounds.py), METHOD SNRE_C or SNPE_C: FOLDER holds observation.npy (d,),
the study's module and job.json ({"prior": ..., "samples": n, "seed": s, "experiment":
"module:Class", "simulations": total, "rounds": r}). The simulator runs here: the study
class (a kit study, imported from FOLDER with the repository root on the path) simulates
every round. Round 1 draws total / r parameters from the prior, each later round as many
from the previous round's posterior with x_o as its default x (`set_default_x`), the
proposal; SNPE_C is told the proposal (`append_simulations(theta, x, proposal=...)`), SNRE_C
needs none. Every round calls `train()` with sbi's defaults (sbi keeps all rounds'
simulations and trains the same network on). Then `build_posterior()` as is draws the
samples for x_o. Writes METHOD-samples.npy (n, p) and METHOD.json: the CPU seconds of the
rounds (simulating, training and drawing each next proposal) and of the final sampling.
"""

import importlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sbi.inference import NPE_C, NRE_A, NRE_C  # noqa: E402
from sbi.utils import BoxUniform  # noqa: E402

METHODS = {"NRE_A": NRE_A, "NRE_C": NRE_C}
# sbi 0.27 names the sequential classes SNRE_C and SNPE_C as deprecated aliases of these.
SEQUENTIAL = {"SNRE_C": NRE_C, "SNPE_C": NPE_C}
REPO = Path(__file__).resolve().parent.parent


def make_prior(spec):
    """The prior the bench describes: a box, or a centred normal (standard unless a covariance is given)."""
    if spec["kind"] == "box":
        return BoxUniform(
            torch.tensor(spec["low"], dtype=torch.float32), torch.tensor(spec["high"], dtype=torch.float32)
        )
    dimension = spec["dimension"]
    covariance = torch.tensor(spec["covariance"]) if "covariance" in spec else torch.eye(dimension)
    return torch.distributions.MultivariateNormal(torch.zeros(dimension), covariance)


def main(folder, method):
    """Train, build the default posterior, sample every observation; write samples and CPU seconds."""
    torch.set_num_threads(1)
    folder = Path(folder)
    job = json.loads((folder / "job.json").read_text())
    torch.manual_seed(job["seed"])
    theta = torch.from_numpy(np.load(folder / "theta.npy")).float()
    x = torch.from_numpy(np.load(folder / "x.npy")).float()
    observations = torch.from_numpy(np.load(folder / "observations.npy")).float()
    start = time.process_time()
    inference = METHODS[method](prior=make_prior(job["prior"]), show_progress_bars=False)
    inference.append_simulations(theta, x).train()
    posterior = inference.build_posterior()
    train_seconds = time.process_time() - start
    samples, sample_seconds = [], []
    for x_o in observations:
        start = time.process_time()
        drawn = posterior.sample((job["samples"],), x=x_o[None], show_progress_bars=False)
        sample_seconds.append(time.process_time() - start)
        samples.append(drawn.double().numpy())
    np.save(folder / f"{method}-samples.npy", np.stack(samples))
    (folder / f"{method}.json").write_text(
        json.dumps(
            {
                "train_cpu_seconds": train_seconds,
                "sample_cpu_seconds": sample_seconds,
                "epochs": int(inference.summary["epochs_trained"][-1])
                if inference.summary.get("epochs_trained")
                else None,
            }
        )
    )


def load_study(folder, spec):
    """The kit study class `module:Class`, its module imported from `folder` (the repository on the path)."""
    sys.path[:0] = [str(folder), str(REPO)]
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)({})


def sequential(folder, method):
    """Rounds of sbi's sequential method for the one observation; final samples; CPU seconds."""
    torch.set_num_threads(1)
    folder = Path(folder)
    job = json.loads((folder / "job.json").read_text())
    torch.manual_seed(job["seed"])
    study = load_study(folder, job["experiment"])
    x_o = torch.from_numpy(np.load(folder / "observation.npy")).float()
    generator = torch.Generator().manual_seed(job["seed"])
    prior = make_prior(job["prior"])
    per_round = job["simulations"] // job["rounds"]
    start = time.process_time()
    inference = SEQUENTIAL[method](prior=prior, show_progress_bars=False)
    proposal, rounds = prior, []
    for r in range(job["rounds"]):
        begun = time.process_time()
        theta = proposal.sample((per_round,), **({} if proposal is prior else {"show_progress_bars": False}))
        drawn = time.process_time()
        x = study.simulate(theta.double(), generator).float()
        simulated = time.process_time()
        if method == "SNPE_C":
            inference.append_simulations(theta, x, proposal=proposal)
        else:
            inference.append_simulations(theta, x, from_round=r)
        estimator = inference.train()
        proposal = inference.build_posterior(estimator).set_default_x(x_o)
        rounds.append(
            {
                "proposal_cpu_seconds": drawn - begun,
                "simulate_cpu_seconds": simulated - drawn,
                "train_cpu_seconds": time.process_time() - simulated,
                "epochs": int(inference.summary["epochs_trained"][-1]),
            }
        )
        print(f"{method} round {r + 1}: {rounds[-1]}", flush=True)
    train_seconds = time.process_time() - start
    start = time.process_time()
    samples = proposal.sample((job["samples"],), show_progress_bars=False)
    sample_seconds = time.process_time() - start
    np.save(folder / f"{method}-samples.npy", samples.double().numpy())
    (folder / f"{method}.json").write_text(
        json.dumps({"train_cpu_seconds": train_seconds, "sample_cpu_seconds": sample_seconds, "rounds": rounds})
    )


if __name__ == "__main__":
    (sequential if sys.argv[2] in SEQUENTIAL else main)(*sys.argv[1:3])
