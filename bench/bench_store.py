"""Benchmark store.py: deep-verify throughput vs plain hashlib, cache-hit and commit latency.

Run: python bench/bench_store.py [--count 20] [--mib 16]
Target: verify throughput / hashlib throughput >= 0.8.
"""

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import Store  # noqa: E402


def fill_store(s, count, mib):
    """Commit `count` artifacts of `mib` MiB each, filled in chunks through allocate()."""
    n = mib * (1 << 20) // 8

    def build(i):
        """Return a build filling one float64 array with distinct data."""

        def run(writer):
            mm = writer.allocate("data", (n,), np.float64)
            step = 1 << 20
            for start in range(0, n, step):
                stop = min(start + step, n)
                mm[start:stop] = np.arange(start, stop, dtype=np.float64) + i

        return run

    return [s.get("bulk", {"i": i, "mib": mib}, build(i)) for i in range(count)]


def time_hashlib(paths):
    """Seconds for plain hashlib.file_digest SHA-256 over every file."""
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            hashlib.file_digest(f, "sha256")
    return time.perf_counter() - t


def time_verify(s, count):
    """Seconds for one deep store.verify(), checking it finds no damage."""
    t = time.perf_counter()
    checked, damaged = s.verify()
    elapsed = time.perf_counter() - t
    assert checked == count and not damaged, (checked, damaged)
    return elapsed


def bench_verify(s, arts):
    """Print deep-verify vs hashlib throughput (best of three, alternating, page cache warm)."""
    paths = [a.path / f for a in arts for f in a.files]
    total_mb = sum(p.stat().st_size for p in paths) / 1e6
    hl, vf = [], []
    for _ in range(3):
        hl.append(time_hashlib(paths))
        vf.append(time_verify(s, len(arts)))
    hl_rate, vf_rate = total_mb / min(hl), total_mb / min(vf)
    print(f"deep verify : {len(arts)} artifacts, {total_mb:.0f} MB")
    print(f"  hashlib    {hl_rate:8.0f} MB/s")
    print(f"  verify     {vf_rate:8.0f} MB/s")
    print(f"  ratio verify/hashlib = {vf_rate / hl_rate:.2f}  (target >= 0.8)")


def bench_get_hit(s, repeats=2000):
    """Print the median latency of get() on a committed artifact."""
    recipe = {"hit": True, "params": {"lr": 1e-3, "layers": [64, 64]}}
    s.get("small", recipe, lambda w: w.array("x", np.arange(100.0)) and None)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        s.get("small", recipe)
        times.append(time.perf_counter() - t)
    print(f"get (cache hit)       : median {statistics.median(times) * 1e6:7.1f} us over {repeats}")


def bench_commit(s, repeats=50):
    """Print the median latency of building and committing a small artifact, fsyncs included."""
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        s.get("commit", {"i": i}, lambda w: (w.array("x", np.arange(1000.0)), w.json("m", {"i": 1}), None)[-1])
        times.append(time.perf_counter() - t)
    print(f"commit (small, fsync) : median {statistics.median(times) * 1e3:7.2f} ms over {repeats}")


def main():
    """Parse arguments and run all benchmarks in a temporary output root."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--mib", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as root:
        s = Store(root)
        t = time.perf_counter()
        arts = fill_store(s, args.count, args.mib)
        print(f"setup: committed {args.count} x {args.mib} MiB in {time.perf_counter() - t:.1f} s")
        bench_verify(s, arts)
        bench_get_hit(s)
        bench_commit(s)


if __name__ == "__main__":
    main()
