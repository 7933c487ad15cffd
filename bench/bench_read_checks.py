"""What checking every read against its checksum costs: on a cache hit, and within a `default` job.

Run: python bench/bench_read_checks.py [--no-job]

1. A cache hit (`Store.get` of a committed artifact), three ways side by side: the size check
   alone (what reads did before), the checked read of a file this process already found
   intact (the usual case within a launch), and a first, hashing read.
2. One job of the `default` profile (problem dimension 1, the uniform prior) run by nnpd,
   then every artifact it used read once more with a cold memory of what was hashed: that
   hashing, as a share of the job's wall time. Target: under 2 %.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import store  # noqa: E402

ONE_JOB = """

_default_make_settings = make_settings


def make_settings(profile):
    settings = _default_make_settings(profile)
    settings["problem"]["dimension"] = 1
    settings["cohort"]["priors"] = ["uniform"]
    settings["output"]["root"] = "out"
    return settings
"""


def median_us(call, repeats):
    """Median microseconds of call() over repeats."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def bench_cache_hit(root, repeats=500):
    """Print get()'s latency for a small and a 16 MiB artifact: size only, checked (remembered), checked (cold)."""
    s = store.Store(root)
    for label, values in (("small (800 B)", np.arange(100.0)), ("16 MiB", np.arange(float(2 << 20)))):
        recipe = {"label": label}
        artifact = s.get("hit", recipe, lambda w, v=values: w.array("x", v) and None)
        time.sleep(store._SETTLED_NS / 1e9 + 0.1)  # committed long enough ago to be remembered once hashed
        path = str(artifact.path)
        count = repeats if values.size < 1000 else 20
        size_only = median_us(lambda: store._open(path, deep=False), count)
        remembered = median_us(lambda: s.get("hit", recipe), count)
        cold = median_us(lambda: (store._HASHED.clear(), s.get("hit", recipe)), count)
        print(
            f"cache hit, {label:13s}: size only {size_only:8.1f} us | checked, already hashed {remembered:8.1f} us "
            f"({remembered / size_only:.2f}x) | checked, first read {cold:8.1f} us ({cold / size_only:.2f}x)"
        )


def bench_job(work):
    """Print a default job's wall time and the cost of hashing everything it read once more."""
    settings = Path(work) / "s"
    settings.mkdir()
    shutil.copy(REPO / "settings_analysis.py", settings)
    (settings / "settings_training.py").write_text((REPO / "settings_training.py").read_text() + ONE_JOB)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "run", "--profile", "default", "--settings-dir", str(settings)],
        cwd=work,
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    root = Path(work) / "out"
    used = [
        root / path for run in root.glob("runs/*/*/artifacts.json") for path in json.loads(run.read_text()).values()
    ]
    size = sum(f.stat().st_size for path in used for f in path.iterdir())
    time.sleep(store._SETTLED_NS / 1e9)
    hashing = []
    for _ in range(3):
        store._HASHED.clear()
        started = time.perf_counter()
        assert all(store._open(str(path))[0] is not None for path in used)
        hashing.append(time.perf_counter() - started)
    sizes = [median_us(lambda: [store._open(str(path), deep=False) for path in used], 5) / 1e6]
    extra = min(hashing) - sizes[0]
    print(f"default job (d=1, uniform): {wall:.1f} s wall; it read {len(used)} artifacts, {size / 1e6:.1f} MB")
    print(
        f"  hashing them all once: {min(hashing) * 1e3:.1f} ms (size checks alone {sizes[0] * 1e3:.2f} ms): "
        f"{100 * extra / wall:.3f} % of the job (target < 2 %)"
    )
    print(f"  hash rate {size / min(hashing) / 1e6:.0f} MB/s")


def main():
    """Run both benchmarks in a temporary folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-job", action="store_true", help="skip the default job (about a minute or two)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-read-checks-") as work:
        bench_cache_hit(Path(work) / "hits")
        if not args.no_job:
            bench_job(work)


if __name__ == "__main__":
    main()
