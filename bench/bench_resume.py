"""Benchmark: the cost of resumable training state, and of stop polling under DDP.

Default size: 70,000 train rows of width 2, 15,000 validation rows, MLP [64, 64, 64, 64],
batch 128, Adam, 5 epochs as in the default profile (a state is saved at each epoch end).
(a) saving: training wall with no saving, saving every 60 s and every 1 s (always also at
    epoch ends), alternated round by round, each state written atomically to a real file
    (temporary file, fsync, os.replace);
(b) resuming: time from the train() call to the first finished step, fresh against resumed
    from a mid-training state file, and the load time of that file;
(c) DDP (2 Gloo ranks under torchrun): training wall without hooks against polling a stop
    flag every step, the ranks exchanging flags after every step or on the trainer's own
    schedule (about every FLAG_EXCHANGE_SECONDS), alternated in one launch.
"""

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_trainer import make_data, make_model  # noqa: E402

import runtime  # noqa: E402
import trainer  # noqa: E402
from store import write_bytes_atomic  # noqa: E402

HIDDEN = [64, 64, 64, 64]


def save_atomically(state, path):
    """torch.save the state through the store's atomic write (temporary file, fsync, rename), as nnpd does."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue())


class FileSaver:
    """A save_state hook writing atomically to one file; it counts saves and their seconds."""

    def __init__(self, path: str):
        self.path, self.count, self.seconds = path, 0, 0.0

    def __call__(self, state: dict) -> None:
        """Save and account."""
        began = time.perf_counter()
        save_atomically(state, self.path)
        self.seconds += time.perf_counter() - began
        self.count += 1


def settings_for(args) -> dict:
    """The training settings of every timed run."""
    return {"epochs": args.epochs, "batch_size": args.batch_size, "learning_rate": 1e-3, "checkpoint": "best"}


def timed_training(args, data, rt, hooks) -> float:
    """Wall seconds of one training from the same initial model."""
    began = time.perf_counter()
    trainer.train(make_model(2, HIDDEN), data, settings_for(args), rt, seed=0, hooks=hooks)
    return time.perf_counter() - began


def saving_cost(args, data, rt, folder) -> None:
    """(a) Training wall with no saving, saving every 60 s and every 1 s, alternated."""
    intervals = {"no saving": 0, "every 60 s": 60.0, "every 1 s": 1.0}
    walls = {name: [] for name in intervals}
    savers = {}
    for round_index in range(args.repeats):
        names = list(intervals) if round_index % 2 == 0 else list(reversed(intervals))  # no order favours a case
        for name in names:
            seconds = intervals[name]
            saver = FileSaver(os.path.join(folder, "state.pt")) if seconds else None
            hooks = trainer.TrainingHooks(save_state=saver, save_seconds=seconds) if saver else None
            walls[name].append(timed_training(args, data, rt, hooks))
            savers[name] = saver
    base = min(walls["no saving"])
    size = os.path.getsize(os.path.join(folder, "state.pt")) / 1e6
    print(f"(a) saving state: {args.epochs} epochs, best of {args.repeats} alternated rounds; state file {size:.2f} MB")
    for name, wall in walls.items():
        line = f"    {name:11s} {min(wall):7.2f} s  {100 * (min(wall) / base - 1):+6.2f} % of training wall"
        saver = savers[name]
        if saver:
            line += f"   ({saver.count} saves in the last round, {1000 * saver.seconds / saver.count:.1f} ms each)"
        print(line)
    # Short CPU epochs leave few periodic saves to time, so also scale one save's cost to each interval.
    each = min(saver.seconds / saver.count for saver in savers.values() if saver)
    print(
        f"    one save (gather, copy, torch.save, fsync, rename) takes {1000 * each:.1f} ms: "
        f"{100 * each / 60:.3f} % of a 60 s interval, {100 * each:.2f} % of a 1 s interval"
    )


class FirstStep:
    """A stop_requested hook that never stops and notes when the first step finished."""

    def __init__(self):
        self.at = None

    def __call__(self) -> bool:
        """Note the time of the first poll."""
        if self.at is None:
            self.at = time.perf_counter()
        return False


def mid_training_state(args, data, rt, path) -> None:
    """Save the state half-way through the last epoch, by asking to stop there."""
    steps = -(-args.train_rows // args.batch_size)
    polls = [0]

    def stop() -> bool:
        """Ask to stop half-way through the last epoch."""
        polls[0] += 1
        return polls[0] >= (args.epochs - 1) * steps + steps // 2

    hooks = trainer.TrainingHooks(save_state=FileSaver(path), save_seconds=float("inf"), stop_requested=stop)
    try:
        trainer.train(make_model(2, HIDDEN), data, settings_for(args), rt, seed=0, hooks=hooks)
    except trainer.Preempted as stopped:
        print(f"(b) resuming from a state saved in epoch {stopped.epoch} after batch {stopped.batch}")


def resume_time(args, data, rt, folder) -> None:
    """(b) Time to the first finished step, fresh against resumed; and the state's load time."""
    path = os.path.join(folder, "mid.pt")
    mid_training_state(args, data, rt, path)
    firsts = {"fresh start": [], "resume": []}
    totals = {"fresh start": [], "resume": []}
    loads = []

    def load():
        """torch.load the mid-training state, timed."""
        began = time.perf_counter()
        state = torch.load(path, weights_only=True)
        loads.append(time.perf_counter() - began)
        return state

    for _ in range(args.repeats):
        for name in firsts:
            probe = FirstStep()
            hooks = trainer.TrainingHooks(stop_requested=probe, load_state=load if name == "resume" else None)
            began = time.perf_counter()
            trainer.train(make_model(2, HIDDEN), data, settings_for(args), rt, seed=0, hooks=hooks)
            firsts[name].append(probe.at - began)
            totals[name].append(time.perf_counter() - began)
    for name in firsts:
        print(
            f"    {name:11s} first step after {1000 * min(firsts[name]):7.1f} ms, "
            f"training finished after {min(totals[name]):6.2f} s (best of {args.repeats})"
        )
    print(f"    torch.load of the state file: {1000 * min(loads):.1f} ms")


def ddp_overhead(args) -> None:
    """(c) Launch 2 Gloo ranks running this script's DDP worker and print its result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.abspath(__file__),
        "--ddp-worker",
        "--epochs",
        "1",
        "--repeats",
        str(args.repeats),
        "--train-rows",
        str(args.train_rows),
        "--validation-rows",
        str(args.validation_rows),
        "--batch-size",
        str(args.batch_size),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    print(done.stdout.rstrip() or done.stderr[-3000:])


def ddp_cases() -> dict:
    """DDP cases: (hooks, seconds between flag exchanges)."""
    never = lambda: False  # noqa: E731
    path = os.path.join(tempfile.gettempdir(), f"bench-resume-ddp-{os.getpid()}.pt")
    adaptive = trainer.FLAG_EXCHANGE_SECONDS
    return {
        "no hooks": (None, adaptive),
        "stop polled, exchange every step": (trainer.TrainingHooks(stop_requested=never), 0.0),
        f"stop polled, exchange every {adaptive:g} s": (trainer.TrainingHooks(stop_requested=never), adaptive),
        "the same + saving every 60 s": (
            trainer.TrainingHooks(
                stop_requested=never, save_seconds=60.0, save_state=lambda state: save_atomically(state, path)
            ),
            adaptive,
        ),
    }


def ddp_worker(args) -> None:
    """Under torchrun: alternate training without hooks and with per-step stop polling; rank 0 prints."""
    rt = runtime.start({"device": "cpu", "parallel": "ddp", "deterministic": False})
    try:
        data, cases = make_data(args.train_rows, args.validation_rows, 2), ddp_cases()
        walls = {name: [] for name in cases}
        timed_training(args, make_data(2048, 256, 2), rt, None)  # warm-up
        for round_index in range(args.repeats):
            names = list(cases) if round_index % 2 == 0 else list(reversed(cases))  # no order favours a case
            for name in names:
                hooks, trainer.FLAG_EXCHANGE_SECONDS = cases[name]
                runtime.barrier(rt)
                walls[name].append(timed_training(args, data, rt, hooks))
        if rt.is_main:
            base = min(walls["no hooks"])
            steps = -(-args.train_rows // args.batch_size)
            print(f"(c) DDP, 2 Gloo ranks, 1 epoch of {steps} steps, best of {args.repeats} alternated rounds")
            for name, wall in walls.items():
                print(
                    f"    {name:34s} {min(wall):6.2f} s  {100 * (min(wall) / base - 1):+6.2f} %  "
                    f"({1e6 * (min(wall) - base) / steps:+.0f} us per step)"
                )
    finally:
        runtime.stop(rt)


def main() -> None:
    """Run (a), (b) and (c) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-rows", type=int, default=70_000)
    parser.add_argument("--validation-rows", type=int, default=15_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of each case")
    parser.add_argument("--skip-ddp", action="store_true", help="leave out (c)")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)
    torch.set_num_threads(1)
    rt = runtime.Runtime(device=torch.device("cpu"), deterministic=False)
    data = make_data(args.train_rows, args.validation_rows, 2)
    print(f"rows={args.train_rows} batch={args.batch_size} mlp={HIDDEN} threads=1")
    timed_training(args, make_data(2048, 256, 2), rt, None)  # warm-up: one-off imports
    with tempfile.TemporaryDirectory() as folder:
        saving_cost(args, data, rt, folder)
        resume_time(args, data, rt, folder)
    if not args.skip_ddp:
        ddp_overhead(args)


if __name__ == "__main__":
    main()
