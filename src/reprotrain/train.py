"""The training-step script: a Hydra app that trains and records the run in MLflow.

    python -m reprotrain.train                                   # conf/config.yaml defaults
    python -m reprotrain.train device=cpu optimizer=sgd optimizer.lr=3e-4 model=mlp_wide
    python -m reprotrain.train model=cnn data=digits_images      # a small CNN on 1x8x8 images
    python -m reprotrain.train experiment=smoke                  # a few steps on tiny data
    python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256
    python -m reprotrain.train --cfg job                         # print the composed config
    reprotrain-train --help                                      # the same app by name

Where things are: cli.py (the Hydra app) -> runtime/ (this process, a container, torchrun)
-> build.py (instantiate data, model, loss, optimizer, scheduler) -> trainer.py (the Trainer:
the five steps of step.py, forward, loss, zero_grad, backward, step) -> tracking/ (MLflow).
What only prints from conf/ (--help, Tab completion, --cfg job, --info) is config_app.py.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from reprotrain import config_app


def main() -> None:
    """Train as the command line says (cli.py); what Hydra only prints, from conf/ alone."""
    if config_app.prints_only(sys.argv[1:]):
        config_app.main(sys.argv[1:])
        return
    # Imported for a run only: cli.py brings torch, MLflow and the training code, which --help
    # and Tab completion never use (--help took 4.6 s with them, 1.3 s without, on a 2-core
    # machine: docs/performance.md).
    from reprotrain.cli import main as train

    train()


class _CallableModule(types.ModuleType):
    """`reprotrain.train` names two things: this module (`python -m reprotrain.train`, the
    console script) and the library call `reprotrain.train([...])`. Once this module has been
    imported, the package's attribute `train` is the module, so calling the module calls
    the function (api.train) and both spellings keep working in any process."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module("reprotrain.api").train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
