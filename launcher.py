"""`python launcher.py ARGS` is `torchrun ARGS`, except that a launch stopped by a signal ends in one line.

torchrun turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a SignalException: it passes the
signal on to its workers, waits for them to stop (nnpd's save their training state
first), then lets the exception end the process with a traceback and exit status 1, which
a scheduler records as a failed job. Here that exception ends the launch with one line and
the status of a process killed by the signal (143 for SIGTERM, 130 for SIGINT). Every other
outcome, exit status and output is torchrun's own.
"""
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

DEATH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)   # those torchrun handles


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


def main(argv=None):
    """Run torchrun with these arguments (by default the command line's); returns the exit status."""
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as stop:
        ignore_further_signals()
        print(stopped_line(stop.sigval), file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
