"""Wall time of a fully cached `run --profile smoke` against `python -c "import torch"`.

The smoke study runs once in a temporary directory to fill the store; then the
cached re-run and the bare torch import are timed alternately in the same run, as whole
processes. Target: the re-run at most 1.2x the import (what is left beyond importing
torch is nnpd's fixed cost per launch).
"""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command, cwd):
    """Seconds one command takes; fails loudly if it fails."""
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - started


def main(repeats=7):
    """Print both medians and their ratio (target <= 1.2)."""
    with tempfile.TemporaryDirectory() as work:
        for name in ("settings_training.py", "settings_analysis.py"):
            shutil.copy(REPO / name, Path(work) / name)
        run = [sys.executable, str(REPO / "nnpd.py"), "run", "--profile", "smoke"]
        print(f"first run (fills the store): {timed(run, work):.1f} s")
        rerun, bare = [], []
        for _ in range(repeats):
            rerun.append(timed(run, work))
            bare.append(timed([sys.executable, "-c", "import torch"], work))
        launch = json.loads((Path(work) / "outputs" / "smoke" / "timings.json").read_text())["wall_s"]
    print(f"cached re-run   median {statistics.median(rerun):.2f} s  {[round(t, 2) for t in rerun]}")
    print(f"import torch    median {statistics.median(bare):.2f} s  {[round(t, 2) for t in bare]}")
    print(f"the last re-run's launch itself (its timings.json wall_s, after imports and planning): {launch:.3f} s")
    ratio = statistics.median(rerun) / statistics.median(bare)
    print(f"ratio: {ratio:.2f} (target <= 1.2) {'OK' if ratio <= 1.2 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
