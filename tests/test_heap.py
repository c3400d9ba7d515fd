"""The cyclic garbage collector over a run's start (heap.py): the imports of torch, Hydra and
MLflow are made without a full collection walking them again and again, in the training
process and in its tracking worker, and what that keeps is small."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import PYTHON, Store, child_env, train_args

# Counts each process's full (generation 2) collections into `<folder>/<role>-<pid>`, written
# at each one: the tracking worker leaves with os._exit, so nothing can wait for its exit.
PROBE = textwrap.dedent(
    """
    import gc, os, sys
    folder = os.environ["REPROTRAIN_GC_PROBE"]
    role = "worker" if sys.argv[:1] == ["-c"] else "trainer"
    full = []
    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(1)
            with open(os.path.join(folder, f"{role}-{os.getpid()}"), "w") as out:
                out.write(str(len(full)))
    gc.callbacks.append(count)
    """
)


def python(script: str) -> subprocess.CompletedProcess:
    """`python -c SCRIPT` in a fresh interpreter, which must succeed."""
    result = subprocess.run(
        [PYTHON, "-c", script], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def full_collections(folder: Path, role: str) -> int:
    return sum(int(p.read_text()) for p in folder.glob(f"{role}-*"))


def test_a_run_start_walks_its_imports_at_most_a_few_times(tmp_path: Path, store: Store) -> None:
    """Without the pause, this run's training process made 7 full collections and its worker
    9 (~0.5 s and ~1.5 s of their start on a 2-core VM); with it, 3 and 3, over what was
    made after the imports (the run's data, model, optimizer; the export's warm-up)."""
    probe = tmp_path / "probe"
    counts = tmp_path / "counts"
    probe.mkdir()
    counts.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    env = child_env(REPROTRAIN_GC_PROBE=str(counts))
    env["PYTHONPATH"] = ":".join(filter(None, [str(probe), env.get("PYTHONPATH", "")]))
    result = subprocess.run(
        train_args(tmp_path, store.uri, "train.steps=200", "tracking.log_model=true"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert store.only_run().info.status == "FINISHED"
    trainer, worker = full_collections(counts, "trainer"), full_collections(counts, "worker")
    assert list(counts.glob("worker-*")), "the probe saw no tracking worker"
    assert trainer <= 4 and worker <= 4, (trainer, worker)


def test_imports_kept_out_of_collections_hold_little_garbage() -> None:
    """What long_lived freezes includes the garbage cycles the imports made, never freed: a
    few MB (copies of sys.modules in import frames, mostly)."""
    script = textwrap.dedent(
        """
        import gc, sys
        from reprotrain.heap import long_lived
        full = []
        gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
        with long_lived():
            from reprotrain.cli import main
            from mlflow.tracking import MlflowClient
            import mlflow.pytorch
        assert gc.isenabled() and not full and gc.get_freeze_count() > 100_000, (full, gc.get_freeze_count())
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        print(sum(sys.getsizeof(o) for o in gc.garbage))
        """
    )
    result = python(script)
    kept = int(result.stdout.split()[-1])
    assert 0 < kept < 32 * 2**20, kept


def test_long_lived_leaves_a_paused_collector_paused() -> None:
    script = textwrap.dedent(
        """
        import gc
        from reprotrain.heap import long_lived
        gc.disable()
        with long_lived():
            pass
        assert not gc.isenabled()
        gc.enable()
        try:
            with long_lived():
                assert not gc.isenabled()
                raise ValueError
        except ValueError:
            pass
        assert gc.isenabled()
        """
    )
    python(script)


@pytest.mark.parametrize("held", ["pytorch_lightning", "lightning"])
def test_mlflow_pytorch_is_imported_without_lightning_which_stays_importable(held: str) -> None:
    """mlflow.pytorch imports Lightning where it is installed, for an autolog callback
    reprotrain does not use (~2.4 s); the worker holds it back for that import only."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        if importlib.util.find_spec("{held}") is None:
            print("absent")
            raise SystemExit
        from reprotrain.tracking.worker import import_model_logging
        import_model_logging()
        assert "mlflow.pytorch" in sys.modules and "{held}" not in sys.modules
        import mlflow.pytorch, {held}
        print("ok", mlflow.pytorch.log_model.__name__, {held}.__name__)
        """
    )
    result = python(script)
    if result.stdout.startswith("absent"):
        pytest.skip(f"{held} is not installed here (the `bench` extra installs it)")
    assert result.stdout.startswith("ok"), result.stdout
