"""The training-step script: a Hydra app that trains and records the run in MLflow.

    python -m reprotrain.train                                   # conf/config.yaml defaults
    python -m reprotrain.train device=cpu optimizer=sgd optimizer.lr=3e-4 model=mlp_wide
    python -m reprotrain.train model=cnn data=digits_images      # a small CNN on 1x8x8 images
    python -m reprotrain.train experiment=smoke                  # a few steps on tiny data
    python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256
    python -m reprotrain.train --cfg job                         # print the composed config

Where things are: cli.py (the Hydra app) -> runtime/ (this process or a container) ->
build.py (instantiate data, model, loss, optimizer, scheduler) -> loop.py (the five steps:
forward, loss, zero_grad, backward, step; step.py) -> tracking/ (MLflow).
"""

import sys

from reprotrain.heap import long_lived

# Hydra flags under which this process trains nothing itself (a sweep's jobs get their own
# tracking worker, wherever its launcher runs them).
TRAINS_NOTHING = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg")


def said_false(key: str) -> bool:
    """Whether the command line turns `key` off (key=false, +key=false, ++key=false)."""
    return any(a.lstrip("+").lower() == f"{key}=false" for a in sys.argv[1:])


with long_lived():  # torch, Hydra, ...: imported once, kept for the process's life (heap.py)
    from reprotrain.tracking import start_early

    flags = {a.split("=")[0] for a in sys.argv[1:]}
    if (
        __name__ == "__main__"
        and not flags & set(TRAINS_NOTHING)
        and not said_false("tracking.enabled")
    ):
        # The run's tracking worker imports MLflow on another core while torch loads.
        start_early(model_likely=not said_false("tracking.log_model"))

    from reprotrain.cli import main  # after the worker has started

if __name__ == "__main__":
    main()
