"""The training-step script: a Hydra app that trains and records the run in MLflow.

    python -m reprotrain.train                                   # conf/config.yaml defaults
    python -m reprotrain.train device=cpu optimizer=sgd optimizer.lr=3e-4 model=mlp_wide
    python -m reprotrain.train model=cnn data=digits_images      # a small CNN on 1x8x8 images
    python -m reprotrain.train experiment=smoke                  # a few steps on tiny data
    python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256
    python -m reprotrain.train --cfg job                         # print the composed config

Where things are: cli.py (the Hydra app) -> runtime/ (this process, a container, torchrun)
-> build.py (instantiate data, model, loss, optimizer, scheduler) -> trainer.py (the Trainer:
the five steps of step.py, forward, loss, zero_grad, backward, step) -> tracking/ (MLflow).
"""

from reprotrain.cli import main

if __name__ == "__main__":
    main()
