#!/usr/bin/env bash
# GPU check: run on a machine with an NVIDIA GPU, after scripts/setup.sh (or with PYTHON set to
# an interpreter that has reprotrain's dependencies and a CUDA build of torch).
#
#   scripts/gpu-check.sh              # CUDA vs CPU smoke runs, fast paths, gpu tests, comparison, crossover
#   scripts/gpu-check.sh --docker     # also build the CUDA image and train in it with --gpus all
#
# Prints the figures docs/performance.md's GPU section quotes; writes everything under results/gpu-check/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-results/gpu-check}"
mkdir -p "$OUT"
STORE="sqlite:///$(pwd)/$OUT/mlflow.db"
say() { printf '\n== gpu-check: %s\n' "$*"; }

say "machine"
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi -L || { echo "gpu-check: nvidia-smi lists no GPU; this script needs one" >&2; exit 1; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

say "smoke runs: device=cuda and device=cpu, side by side"
for device in cuda cpu; do
    "$PY" -m reprotrain.train runtime=local device="$device" data.num_samples=8192 \
        train.steps=300 train.progress=lines tracking.uri="$STORE" \
        tracking.run_name="gpu-check-$device" train.output_dir="$OUT/$device"
done
"$PY" - "$STORE" "$OUT" <<'PYCHECK'
import json, sys
import torch
from mlflow.tracking import MlflowClient
store, out = sys.argv[1], sys.argv[2]
client = MlflowClient(store)
runs = {}
for device in ("cuda", "cpu"):
    metrics = json.load(open(f"{out}/{device}/run.json"))
    run = client.get_run(metrics["run_id"])
    assert run.info.status == "FINISHED", run.info.status
    runs[device] = (run, metrics)
name = runs["cuda"][0].data.tags["device.name"]
assert name == torch.cuda.get_device_name(0), (name, torch.cuda.get_device_name(0))
print(f"cuda run's device.name: {name} (matches torch.cuda.get_device_name(0))")
print(f"{'device':<6} {'step ms (median)':>17} {'samples/s':>12} {'to-device ms':>13} {'val acc':>8}")
for device, (run, m) in runs.items():
    print(f"{device:<6} {m['step_ms_median']:>17.3f} {m['samples_per_s']:>12,.0f} "
          f"{m['data_to_device_ms_mean']:>13.4f} {m['val_accuracy']:>8.3f}")
ratio = runs["cpu"][1]["step_ms_median"] / runs["cuda"][1]["step_ms_median"]
print(f"cuda step is {ratio:.2f}x the speed of the cpu step at batch 64 (reference MLP)")
PYCHECK

say "recorded timings on cuda do not depend on the run's length: 300 and 3000 steps, twice"
for round in 1 2; do
    for steps in 300 3000; do
        "$PY" -m reprotrain.train runtime=local device=cuda train.steps="$steps" \
            train.progress=off tracking.uri="$STORE" tracking.log_model=false \
            tracking.run_name="gpu-check-length-$steps" train.output_dir="$OUT/length-$steps-$round"
    done
done
"$PY" - "$OUT" <<'PYLENGTH'
import json, statistics, sys
runs = {n: [json.load(open(f"{sys.argv[1]}/length-{n}-{r}/run.json")) for r in (1, 2)] for n in (300, 3000)}
phases = ("data_to_device", "forward", "backward", "optimizer")
ok = True
for n, recorded in runs.items():
    for m in recorded:
        total = sum(m[f"{p}_ms_mean"] for p in phases)
        step_ms = m["batch_size"] * 1e3 / m["samples_per_s"]  # the mean step samples/s gives
        close = abs(total / step_ms - 1) <= 0.10
        ok &= close
        print(f"{n} steps: {m['samples_per_s']:,.0f} samples/s, phase means {total:.4f} ms "
              f"against a step of {step_ms:.4f} ms from samples/s ({'within' if close else 'NOT within'} 10%; "
              f"median step {m['step_ms_median']:.4f} ms)")
# As tests/test_train.py: the machine's own speed divided out (samples/s per sample-rate of
# the run's median step), the median over the pairs of rounds.
short, long = (statistics.median(m["samples_per_s"] for m in runs[n]) for n in runs)
efficiency = {n: [m["samples_per_s"] * m["step_ms_median"] / (m["batch_size"] * 1e3) for m in runs[n]] for n in runs}
ratio = statistics.median(a / b for a, b in zip(efficiency[300], efficiency[3000]))
close = abs(ratio - 1) <= 0.10
ok &= close
print(f"samples/s, 300 steps / 3000 steps: {short / long:.3f} raw, {ratio:.3f} with the machine's "
      f"speed divided out ({'within' if close else 'NOT within'} 10%)")
sys.exit(0 if ok else 1)
PYLENGTH

say "the CNN on the digits as images, with a cosine schedule, on cuda; loaded back through MLflow"
"$PY" -m reprotrain.train runtime=local device=cuda model=cnn data=digits_images scheduler=cosine \
    train.steps=300 train.progress=off tracking.uri="$STORE" tracking.run_name=gpu-check-cnn \
    train.output_dir="$OUT/cnn"
"$PY" - "$STORE" "$OUT" <<'PYCNN'
import json, sys
import mlflow.pytorch, torch
from reprotrain.data import digits
m = json.load(open(f"{sys.argv[2]}/cnn/run.json"))
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pytorch.load_model(f"runs:/{m['run_id']}/model")  # logged from a CPU copy
x, y = digits(images=True).val.tensors
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
assert abs(accuracy - m["val_accuracy"]) < 0.01, (accuracy, m["val_accuracy"])  # GPU vs CPU rounding
print(f"cnn on cuda: step {m['step_ms_median']:.4f} ms, val accuracy {m['val_accuracy']:.4f}, "
      f"loaded back on the cpu: {accuracy:.4f}")
PYCNN

say "fast paths through the app on cuda: CUDA graph, bf16 + TF32, fp16 with its GradScaler (clipped, accumulated), torch.compile"
for options in "train.cuda_graphs=true" "train.precision=bf16 train.tf32=true train.deterministic=false" "train.precision=fp16 train.deterministic=false train.clip_grad_norm=1.0 train.accumulate_grad_batches=2" "train.compile=true"; do
    slug="${options//[ =.]/-}"
    # shellcheck disable=SC2086  # options is a list of overrides
    if ! "$PY" -m reprotrain.train runtime=local device=cuda data.num_samples=8192 train.steps=300 \
        train.progress=off tracking.uri="$STORE" tracking.run_name="gpu-check-$slug" \
        train.output_dir="$OUT/$slug" $options; then
        [ "$options" = "train.compile=true" ] || exit 1
        echo "gpu-check: torch.compile could not run here (message above); the rest goes on"
        continue
    fi
    "$PY" -c "import json; m = json.load(open('$OUT/$slug/run.json')); \
print('$options: step', round(m['step_ms_median'], 4), 'ms, final loss', m['final_loss'])"
done

say "torchrun with nccl: one process per GPU, one MLflow run; scaling against one process"
TORCHRUN="$(dirname "$PY")/torchrun"
"$TORCHRUN" --standalone --nproc-per-node=gpu -m reprotrain.train runtime=local device=cuda \
    data.num_samples=8192 train.steps=300 train.progress=off tracking.uri="$STORE" \
    tracking.log_model=false tracking.run_name=gpu-check-torchrun train.output_dir="$OUT/torchrun"
"$PY" - "$STORE" "$OUT" <<'PYDDP'
import json, sys
import torch
from mlflow.tracking import MlflowClient
store, out = sys.argv[1], sys.argv[2]
ddp, one = (json.load(open(f"{out}/{name}/run.json")) for name in ("torchrun", "cuda"))
tags = MlflowClient(store).get_run(ddp["run_id"]).data.tags
n = torch.cuda.device_count()
assert tags["dist.backend"] == "nccl" and tags["dist.world_size"] == str(n), tags
print(f"torchrun on {n} GPU(s), nccl: {ddp['samples_per_s']:,.0f} samples/s against "
      f"{one['samples_per_s']:,.0f} in one process; scaling efficiency "
      f"{ddp['samples_per_s'] / (n * one['samples_per_s']):.2f}; devices: {tags['dist.devices']}")
PYDDP

say "tests marked gpu"
"$PY" -m pytest -m gpu -q

say "the comparison on cuda: the lesson's script, reprotrain, untracked, Lightning, + the CUDA fast paths"
timeout 900 "$PY" benchmarks/compare.py --device cuda --pairs 3 --json "$OUT/compare-cuda.json" \
    --with train.cuda_graphs=true --with "train.precision=bf16 train.tf32=true train.deterministic=false"

say "CPU-vs-GPU crossover: the app's sweep (experiment=crossover), one MLflow child run per point"
timeout 1200 "$PY" -m reprotrain.train --multirun experiment=crossover tracking.uri="$STORE" \
    tracking.log_model=false train.progress=off train.output_dir="$OUT/crossover" \
    hydra.sweep.dir="$OUT/crossover/sweep" >"$OUT/crossover.log" 2>&1 \
    || { tail -20 "$OUT/crossover.log"; exit 1; }
"$PY" - "$STORE" <<'PYCROSS'
import sys
from mlflow.tracking import MlflowClient
client = MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("reprotrain-crossover")
runs = client.search_runs([experiment.experiment_id], max_results=5000, order_by=["attributes.start_time DESC"])
parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)  # the sweep just run
rate = {}
for r in runs:
    if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id:
        key = (r.data.tags["device.type"], int(r.data.params["model.hidden_size"]), int(r.data.params["train.batch_size"]))
        rate[key] = r.data.metrics["throughput.samples_per_s"]
hiddens, batches = sorted({h for _, h, _ in rate}), sorted({b for _, _, b in rate})
print(f"{'hidden':>6} {'batch':>6} {'cpu samples/s':>14} {'cuda samples/s':>15} {'cuda/cpu':>9}")
for hidden in hiddens:
    wins = []
    for batch in batches:
        cpu, cuda = rate.get(("cpu", hidden, batch)), rate.get(("cuda", hidden, batch))
        ratio = cuda / cpu if cpu and cuda else None
        if ratio and ratio > 1:
            wins.append(batch)
        cells = [f"{v:>14,.0f}" if v else f"{'-':>14}" for v in (cpu, cuda)]
        print(f"{hidden:>6} {batch:>6} {cells[0]} {cells[1]:>15} {f'{ratio:.2f}' if ratio else '-':>9}")
    print(f"hidden {hidden}: the GPU is faster from batch {wins[0] if wins else 'none in range'}")
PYCROSS

if [ "${1:-}" = "--docker" ]; then
    say "CUDA image, trained with docker run --gpus all"
    docker build -f Dockerfile.cuda -t reprotrain:cuda .
    docker image ls reprotrain:cuda --format 'reprotrain:cuda {{.Size}}'
    docker run --rm --gpus all --user "$(id -u):$(id -g)" -e HOME=/tmp \
        -v "$(pwd):$(pwd)" -w "$(pwd)" -e MLFLOW_TRACKING_URI="$STORE" \
        reprotrain:cuda python -m reprotrain.train device=cuda experiment=smoke \
        train.output_dir="$OUT/docker-cuda"
    "$PY" -c "import json; m = json.load(open('$OUT/docker-cuda/run.json')); \
print('docker-cuda run', m['run_id'], m['device_name'])"
    docker run --rm --gpus all --user "$(id -u):$(id -g)" -e HOME=/tmp \
        -v "$(pwd):$(pwd)" -w "$(pwd)" -e MLFLOW_TRACKING_URI="$STORE" \
        reprotrain:cuda torchrun --nproc-per-node=gpu -m reprotrain.train device=cuda \
        experiment=smoke train.output_dir="$OUT/docker-torchrun"
    "$PY" -c "import json; m = json.load(open('$OUT/docker-torchrun/run.json')); \
print('docker-cuda torchrun run', m['run_id'], m['samples_per_s'], 'samples/s')"
fi
say "done: figures above, files in $OUT"
