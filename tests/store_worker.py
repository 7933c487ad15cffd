"""Subprocess helper for tests/test_store.py: real processes racing, dying and locking.

Usage: python store_worker.py MODE ROOT [ARGS...]
  race ROOT COUNTER GO   wait for file GO, then get() a slow artifact; print sha256 of its bytes
  hang ROOT              start a build, write half its files, print "half", then sleep
  trylock ROOT NAME      print "held" or "busy" for a non-blocking lock attempt
"""

import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import store  # noqa: E402

RECIPE = {"n": 1000, "seed": 7}


def race(root, counter, go):
    """Wait for the start signal, then get() an artifact whose build is slow and counted."""

    def build(writer):
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        time.sleep(0.3)  # long enough for the other racers to arrive and wait
        writer.array("x", np.arange(RECIPE["n"], dtype=np.float64) * RECIPE["seed"])
        return {"builder": os.getpid()}

    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.002)
    art = store.Store(root).get("data", RECIPE, build)
    print(hashlib.sha256(art.array("x").tobytes()).hexdigest(), art.path, flush=True)


def hang(root):
    """Write part of an artifact, announce it, and wait to be SIGKILLed."""

    def build(writer):
        writer.array("a", np.ones(100))
        print("half", flush=True)
        time.sleep(60)
        writer.array("b", np.ones(100))

    store.Store(root).get("data", RECIPE, build)


def trylock(root, name):
    """Report whether a non-blocking lock attempt succeeds."""
    with store.Store(root).lock(name, blocking=False) as held:
        print("held" if held else "busy", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"race": race, "hang": hang, "trylock": trylock}[mode](*args)
