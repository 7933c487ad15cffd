"""Peak memory of `run --profile default` restricted to dimension 1 and one prior.

Writes settings that take the default profile and pin the dimension to 1 and the
cohort to the uniform prior, runs the study in a child process and reports the
child's peak resident set size (target: under 2 GiB).
"""

import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATCH = """

_repository_make_settings = make_settings


def make_settings(profile):
    settings = _repository_make_settings(profile)
    settings["problem"]["dimension"] = 1
    settings["cohort"]["priors"] = ["uniform"]
    return settings
"""


def main():
    """Run the restricted default study and print its peak memory."""
    with tempfile.TemporaryDirectory() as work:
        shutil.copy(REPO / "settings_analysis.py", Path(work) / "settings_analysis.py")
        (Path(work) / "settings_training.py").write_text((REPO / "settings_training.py").read_text() + PATCH)
        started = time.perf_counter()
        subprocess.run([sys.executable, str(REPO / "nnpd.py"), "run", "--profile", "default"], cwd=work, check=True)
        elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    print(
        f"run --profile default (dimension 1, uniform prior): {elapsed:.0f} s, peak RSS {peak:.2f} GiB (target < 2 GiB)"
    )


if __name__ == "__main__":
    main()
