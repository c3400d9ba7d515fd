"""Callbacks (reprotrain.callbacks): EarlyStopping's patience, min_delta and direction, the
reason it gives, its state across a resume, and the no-op base class a user's callback
extends. The trainer here is a stand-in with the two things a callback uses of it."""

from __future__ import annotations

import math

from reprotrain.callbacks import Callback, EarlyStopping, improved


class Loop:
    """What a callback sees of the Trainer: its step, and stop_early(reason)."""

    def __init__(self) -> None:
        self.step = 0
        self.stopped: str | None = None

    def stop_early(self, reason: str) -> None:
        self.stopped = reason

    def validate(self, callback: Callback, values: list[float], every: int = 10) -> int | None:
        """Validations every `every` steps with these figures; the step it was stopped at."""
        for value in values:
            self.step += every
            callback.on_validation_end(self, {"val/loss": value, "val/accuracy": -value})
            if self.stopped:
                return self.step
        return None


def test_improved_by_more_than_min_delta_in_either_direction() -> None:
    assert improved(0.5, math.nan, higher=False)  # the first figure is the best so far
    assert improved(0.4, 0.5, higher=False) and not improved(0.6, 0.5, higher=False)
    assert improved(0.6, 0.5, higher=True) and not improved(0.4, 0.5, higher=True)
    assert not improved(0.45, 0.5, higher=False, min_delta=0.1)  # not by more than 0.1
    assert improved(0.39, 0.5, higher=False, min_delta=0.1)
    assert not improved(0.5, 0.5, higher=False)  # equal is no improvement
    for value in (math.nan, math.inf, -math.inf):  # a non-finite figure never improves
        assert not improved(value, 0.5, higher=False) and not improved(value, math.nan, True)


def test_early_stopping_stops_after_patience_validations_without_improvement() -> None:
    stopping, loop = EarlyStopping("val/loss", patience=2), Loop()
    stopped_at = loop.validate(stopping, [1.0, 0.8, 0.9, 0.7, 0.75, 0.71, 0.72])
    assert stopped_at == 60  # best 0.7 at step 40; 50 and 60 did not improve
    assert loop.stopped == (
        "val/loss did not improve by more than 0 for 2 validations (best 0.7 at step 40)"
    )
    assert stopping.state_dict() == {"best": 0.7, "best_step": 40, "waited": 2}


def test_early_stopping_follows_higher_is_better_and_min_delta() -> None:
    stopping = EarlyStopping("val/accuracy", patience=1, min_delta=0.05, higher_is_better=True)
    loop = Loop()
    stopped_at = loop.validate(stopping, [-0.5, -0.6, -0.62])  # accuracy 0.5, 0.6, 0.62
    assert stopped_at == 30 and "val/accuracy" in loop.stopped
    assert "by more than 0.05 for 1 validations (best 0.6 at step 20)" in loop.stopped


def test_early_stopping_resumed_from_its_state_stops_where_it_would_have() -> None:
    figures = [1.0, 0.9, 0.95, 0.96, 0.97]
    whole = Loop().validate(EarlyStopping("val/loss", patience=3), figures)
    first, loop = EarlyStopping("val/loss", patience=3), Loop()
    assert loop.validate(first, figures[:3]) is None
    resumed = EarlyStopping("val/loss", patience=3)
    resumed.load_state_dict(first.state_dict())  # what the checkpoint keeps
    assert loop.validate(resumed, figures[3:]) == whole == 50


def test_a_nan_validation_counts_against_patience() -> None:
    loop = Loop()
    assert loop.validate(EarlyStopping("val/loss", patience=2), [0.5, math.nan, math.nan]) == 30


def test_the_base_callback_does_nothing_at_each_moment_and_keeps_no_state() -> None:
    callback, loop = Callback(), Loop()
    callback.on_train_start(loop)
    callback.on_step_end(loop)
    callback.on_validation_end(loop, {"val/loss": 1.0})
    callback.on_train_end(loop)
    callback.load_state_dict({})
    assert callback.state_dict() == {} and loop.stopped is None
