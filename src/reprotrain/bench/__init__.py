"""The benchmark command, `python -m reprotrain.bench`: see __main__.py for its usage.

reference.py  the reference MLP, its data and config, how long to measure
clock.py      step timing and memory of one measured variant
variants.py   a, b, c, d, the fwd+bwd bound and the matmul ceiling
measure.py    one device, every batch size, with the ratios between variants
startup.py    start-up of the training app and `dvc repro` with nothing to do
crossover.py  the CPU-versus-GPU study, its plot, table and MLflow child runs
report.py     the performance targets, the printed tables, the MLflow metrics
"""
