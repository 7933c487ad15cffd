"""The names of the training's timed phases that the timings read back.

The trainer (trainer.py) and its DDP machinery (ddp.py) time their work under these
names through probes.phase; timings.py reads them to split a training step from DDP's
gradient communication. They live apart so that timings needs neither module to know them.
"""

# The phases of one training step (timed in trainer.py) and of DDP's gradient all-reduce within its backward pass.
STEP_PHASES = ("train.forward", "train.loss", "train.backward", "train.optimizer")
COMMUNICATE = "train.communicate"
