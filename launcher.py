"""`python launcher.py ARGS` is `torchrun ARGS`, except that a launch stopped by a signal ends in one line.

torchrun turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a SignalException: it passes the
signal on to its workers, waits for them to stop (nnpd's save their training state
first), then lets the exception end the process with a traceback and exit status 1, which
a scheduler records as a failed job. Here that exception ends the launch with one line and
the status of a process killed by the signal (143 for SIGTERM, 130 for SIGINT). Every other
outcome, exit status and output is torchrun's own.
"""

import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

__all__ = ["main", "leave_now"]

DEATH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # those torchrun handles
WORKER_GRACE = 60.0  # seconds the launch waits for workers still saving after torchrun gave up on them


def stopped_line(signum):
    """The one line a launch stopped by a signal ends with."""
    name = signal.Signals(signum).name
    return f"nnpd: torchrun stopped by {name} after its workers stopped; the same command resumes from what they saved"


def ignore_further_signals():
    """From here on, death signals change nothing."""
    # Slurm signals every process of a step and srun may forward the signal again: a repeat
    # arriving while the launch ends must not turn the ending into a traceback.
    for signum in DEATH_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def wait_for_workers(seconds=WORKER_GRACE):
    """Wait, at most `seconds`, until every child process (torchrun's workers) has ended; reap them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid == 0:
            time.sleep(0.05)  # children remain, none ended yet


def main(argv=None):
    """Run torchrun with these arguments (by default the command line's); returns the exit status."""
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as stop:
        ignore_further_signals()
        # A repeated signal can interrupt torchrun's own wait for its workers: the line comes after them.
        wait_for_workers()
        print(stopped_line(stop.sigval), file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    return 0


def leave_now(status):
    """End the process with `status` at once, its output flushed, skipping the interpreter's teardown."""
    # The teardown finalises torchrun's objects (its rendezvous' keep-alive thread, its handles on
    # workers already reaped here): on a busy machine one printed a stray "Exception ignored in:"
    # after the stopped line. Once the workers are reaped nothing is left to clean up.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    status = main()
    if status:  # stopped by a signal: the line just printed stays the launch's last word
        leave_now(status)
    sys.exit(status)
