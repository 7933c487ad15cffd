"""sbi's side of bench_posterior_quality.py: train one NRE method on given simulations and sample.

Runs under bench/.venv-sbi's python only (nnpd's environment never imports sbi):

    bench/.venv-sbi/bin/python bench/sbi_runner.py FOLDER METHOD

FOLDER holds theta.npy (n, p), x.npy (n, d), observations.npy (m, d) and job.json
({"prior": ..., "samples": n, "seed": s}); METHOD is NRE_A or NRE_C, each with sbi's
defaults: `train()` as is, `build_posterior()` as is (its default MCMC sampler). Writes
METHOD-samples.npy (m, n, p) and METHOD.json with the CPU seconds of training and of
each observation's sampling.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sbi.inference import NRE_A, NRE_C  # noqa: E402
from sbi.utils import BoxUniform  # noqa: E402

METHODS = {"NRE_A": NRE_A, "NRE_C": NRE_C}


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


if __name__ == "__main__":
    main(*sys.argv[1:3])
