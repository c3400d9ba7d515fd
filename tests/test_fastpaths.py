"""The fast paths keep the math, and reprotrain's step is the lesson's.

Each test trains twice through the training script's main() (in this process:
conftest.InProcess), the fast path switched by an override, and compares the two runs' loss.csv (every step's loss) and model.pt: bit for bit
where the arithmetic is the same, within float rounding where the path reorders sums, within
bf16's rounding for bf16. Timings are the benchmarks' business (benchmarks/compare.py): no
assertion here is about speed.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import ROOT, InProcess, Store, require_cuda

# 20 steps of batch 32 over 409 training samples: the next epoch's order from step 13 on.
# Tracking is off: the losses do not depend on it, and each run is seconds shorter.
SMALL = ("experiment=smoke", "tracking.enabled=false")
CPU = ("device=cpu", *SMALL)


@pytest.fixture
def trained_losses(tmp_path: Path, here: InProcess):
    def run(name: str, *overrides: str) -> tuple[list[float], dict]:
        """Every step's loss (loss.csv) and the final weights (model.pt) of one run."""
        folder = tmp_path / name
        folder.mkdir()
        here.train(folder, Store(folder), *overrides)
        return losses(folder / "results" / "loss.csv"), weights(folder / "results" / "model.pt")

    return run


def losses(path: Path) -> list[float]:
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == list(range(1, len(rows) + 1))
    return [float(row["loss"]) for row in rows]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_fused_adamw_gives_the_default_adamw_losses(trained_losses) -> None:
    fused, _ = trained_losses("fused", *CPU, "optimizer.fused=true")
    plain, _ = trained_losses("plain", *CPU, "optimizer.fused=false")
    assert len(fused) == len(plain) == 20
    assert fused[0] == plain[0]  # same weights, same first batch
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_resident_batches_give_the_copied_batches_losses(trained_losses) -> None:
    resident, kept = trained_losses("resident", *CPU, "train.resident_data=true")
    copied, moved = trained_losses("copied", *CPU, "train.resident_data=false")
    assert resident == copied and same_weights(kept, moved)


@pytest.mark.gpu
def test_resident_batches_give_the_copied_batches_losses_on_cuda(trained_losses) -> None:
    require_cuda()
    resident, _ = trained_losses("resident", "device=cuda", *SMALL, "train.resident_data=true")
    copied, _ = trained_losses("copied", "device=cuda", *SMALL, "train.resident_data=false")
    torch.testing.assert_close(resident, copied, rtol=1e-6, atol=1e-7)


def test_log_every_does_not_change_the_losses(trained_losses) -> None:
    every_step, first = trained_losses("every-1", *CPU, "train.log_every=1")
    every_25, second = trained_losses("every-25", *CPU, "train.log_every=25")
    assert every_step == every_25 and same_weights(first, second)


@pytest.mark.e2e  # torch.compile builds C++ kernels and loads each in a Python process of its own
def test_compiled_step_gives_the_eager_losses(
    tmp_path: Path, here: InProcess, trained_losses
) -> None:
    folder = tmp_path / "compiled"
    folder.mkdir()
    refused = here.train(folder, Store(folder), *CPU, "train.compile=true", check=False)
    if refused.returncode == 2 and "compile" in refused.stderr:  # no g++ or Python headers
        pytest.skip(f"torch.compile cannot build kernels here: {refused.stderr.strip()}")
    assert refused.returncode == 0, refused.stderr[-3000:]
    compiled = losses(folder / "results" / "loss.csv")
    eager, _ = trained_losses("eager", *CPU)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6)  # same weights, same first batch
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_changes_the_losses_only_by_rounding(trained_losses) -> None:
    bf16, _ = trained_losses("bf16", *CPU, "train.precision=bf16", "train.deterministic=false")
    fp32, _ = trained_losses("fp32", *CPU)
    assert bf16 != fp32  # autocast really ran in bf16
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_and_tf32_steps_on_cuda(trained_losses) -> None:
    require_cuda()
    cuda = ("device=cuda", *SMALL)
    eager, _ = trained_losses("eager", *cuda)
    graphed, _ = trained_losses("graphed", *cuda, "train.cuda_graphs=true")
    assert len(graphed) == len(eager) == 20
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    tf32, _ = trained_losses("tf32", *cuda, "train.tf32=true", "train.deterministic=false")
    torch.testing.assert_close(tf32, eager, rtol=1e-2, atol=1e-2)


# The whole training split in one batch: the lesson's shuffle and reprotrain's epoch order
# then give the same batch each step, in another order, which a mean over it does not see
# (up to the rounding of sums taken in another order).
WHOLE_SPLIT = 6554  # 8192 samples of data=synthetic, 20% held out


def test_reprotrain_gives_the_lesson_losses(tmp_path: Path, trained_losses) -> None:
    """The lesson's script (benchmarks/lesson.py: default AdamW, `loss.item()` every step) and
    reprotrain's step, from the same seed on the same data, train the same model."""
    steps = 4
    ours, _ = trained_losses(
        "reprotrain",
        "device=cpu",
        "tracking.enabled=false",
        f"train.steps={steps}",
        f"train.batch_size={WHOLE_SPLIT}",
        "optimizer.fused=false",  # the lesson's AdamW: the same update, one tensor at a time
    )
    lesson_csv = tmp_path / "lesson.csv"
    spec = importlib.util.spec_from_file_location("lesson", ROOT / "benchmarks" / "lesson.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.set_num_threads(1)  # one thread, as the run above (train.threads=1); put back after
    script.main(
        [
            f"--steps={steps}",
            f"--batch-size={WHOLE_SPLIT}",
            "--device=cpu",
            f"--out={tmp_path / 'lesson.pt'}",
            f"--loss-csv={lesson_csv}",
        ]
    )
    lesson = losses(lesson_csv)
    assert len(lesson) == len(ours) == steps
    torch.testing.assert_close(ours, lesson, rtol=1e-5, atol=1e-6)
