"""One process at a time trains a run (checkpoint.RunLock): a second `train.resume` of a run
that another process holds is one line, and records nothing; once it is let go, the resume
records every step once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

import reprotrain
from conftest import library_args
from reprotrain.checkpoint import RunLock


def test_a_run_held_by_another_process_is_not_resumed_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = reprotrain.train(library_args(tmp_path, "experiment=smoke", "train.steps=8"))
    assert first.status == "FINISHED"
    RunLock(tmp_path / "checkpoints", first.run_id).release()  # let go at its end: free

    held = RunLock(tmp_path / "checkpoints", first.run_id)  # as a second terminal's resume
    try:
        with pytest.raises(reprotrain.ConfigError) as refused:
            reprotrain.train(
                library_args(
                    tmp_path, "experiment=smoke", "train.steps=16", f"train.resume={first.run_id}"
                )
            )
        assert f"run {first.run_id} is being trained by process {os.getpid()}" in str(refused.value)
        assert "train.resume it again" in refused.value.hint
    finally:
        held.release()
    client = MlflowClient(first.tracking_uri)
    assert len(client.get_metric_history(first.run_id, "train/loss")) == 8  # nothing added

    resumed = reprotrain.train(
        library_args(tmp_path, "experiment=smoke", "train.steps=16", f"train.resume={first.run_id}")
    )
    assert resumed.run_id == first.run_id and resumed.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(first.run_id, "train/loss")]
    assert steps == list(range(1, 17))  # every step once
