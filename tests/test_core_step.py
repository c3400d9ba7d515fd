"""The step's knobs (`step.Knobs`) on real torch: gradient clipping, gradient accumulation over
micro-batches, autocast and a GradScaler, and the timing marks between the five steps."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from reprotrain.step import Knobs, train_step
from reprotrain.tasks import Classification

LOSS = nn.CrossEntropyLoss()


def model_and_batches(seed: int = 0) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        x = torch.randn(16, 6, generator=generator) * 5  # large inputs: large gradients
        batches.append((x, torch.randint(0, 3, (16,), generator=generator)))
    return model, batches


def update(before: nn.Module, after: nn.Module) -> torch.Tensor:
    """Every parameter's change, flattened into one vector."""
    pairs = zip(after.parameters(), before.parameters(), strict=True)
    return torch.cat([(a - b).detach().flatten() for a, b in pairs])


def stepped(model: nn.Module, batches: list, knobs: Knobs | None = None, lr: float = 1.0):
    """A copy of `model` after one train_step with plain SGD (update = -lr * gradient)."""
    trained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=lr)
    loss = train_step(trained, batches, Classification().bind(trained), LOSS, optimizer, knobs)
    return trained, loss


def test_clip_grad_norm_scales_the_gradients_total_norm_down_to_it() -> None:
    model, batches = model_and_batches()
    free, _ = stepped(model, batches[:1])
    free_norm = float(update(model, free).norm())
    assert free_norm > 1.0  # the unclipped gradient is longer than the clip below
    clipped, _ = stepped(model, batches[:1], Knobs(clip_grad_norm=1.0))
    step = update(model, clipped)
    assert float(step.norm()) == pytest.approx(1.0, rel=1e-4)
    direction = torch.nn.functional.cosine_similarity(step, update(model, free), dim=0)
    assert float(direction) == pytest.approx(1.0, abs=1e-5)  # scaled, not turned
    loose, _ = stepped(model, batches[:1], Knobs(clip_grad_norm=10 * free_norm))
    torch.testing.assert_close(update(model, loose), update(model, free))  # under it: as is


def test_accumulated_micro_batches_take_the_step_of_their_whole_batch() -> None:
    """k micro-batches, each loss divided by k, gradients added up before one step: the mean
    gradient of the whole batch (equal batch sizes), and the mean of the k losses returned."""
    model, (first, second) = model_and_batches()
    whole = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    one, one_loss = stepped(model, [whole])
    two, two_loss = stepped(model, [first, second])
    torch.testing.assert_close(update(model, two), update(model, one), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two_loss, one_loss)
    with torch.no_grad():
        separate = (LOSS(model(first[0]), first[1]) + LOSS(model(second[0]), second[1])) / 2
    torch.testing.assert_close(two_loss, separate)


def test_accumulation_zeroes_the_gradients_once_and_clips_their_sum() -> None:
    model, (first, second) = model_and_batches()
    whole = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    one, _ = stepped(model, [whole], Knobs(clip_grad_norm=0.5))
    two, _ = stepped(model, [first, second], Knobs(clip_grad_norm=0.5))
    assert float(update(model, two).norm()) == pytest.approx(0.5, rel=1e-4)
    torch.testing.assert_close(update(model, two), update(model, one), rtol=1e-4, atol=1e-6)
    trained = copy.deepcopy(model)
    for p in trained.parameters():
        p.grad = torch.full_like(p, 1e6)  # a previous step's leftovers: zeroed first
    optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
    train_step(trained, [first, second], Classification(), LOSS, optimizer)
    fresh, _ = stepped(model, [first, second])
    torch.testing.assert_close(update(model, trained), update(model, fresh))


class Replica(nn.Module):
    """What DDP adds to a model: no_sync(), which skips the all-reduce of a backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.synced = module, []
        self._in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.synced.append(not self._in_no_sync)
        return self.module(x)


def test_under_ddp_only_the_last_micro_batch_all_reduces() -> None:
    model, (first, second) = model_and_batches()
    replica = Replica(model)
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
    train_step(replica, [first, second, first], Classification(), LOSS, optimizer)
    assert replica.synced == [False, False, True]
    train_step(replica, [first], Classification(), LOSS, optimizer)
    assert replica.synced[-1] is True


def test_the_marks_stamp_each_phase_of_the_step_in_order() -> None:
    model, (first, second) = model_and_batches()
    marks: list[str] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, [first, second], Classification(), LOSS, optimizer, mark=marks.append)
    assert marks == ["forward", "backward", "forward", "backward", "optimizer"]


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_the_weights_fp32() -> None:
    model, batches = model_and_batches()
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    trained, loss = stepped(model, batches[:1], Knobs(autocast=autocast), lr=0.1)
    assert seen[-1] == torch.bfloat16 and loss.dtype == torch.float32  # the loss in fp32
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    plain, plain_loss = stepped(model, batches[:1], lr=0.1)
    assert seen[-1] == torch.float32 and loss != plain_loss  # autocast really ran
    torch.testing.assert_close(loss, plain_loss, rtol=2e-2, atol=2e-2)


def test_a_grad_scaler_scales_the_loss_and_unscales_before_clipping() -> None:
    """fp16's GradScaler: backward on the scaled loss, the gradients unscaled before they are
    clipped and stepped, so the update is the unscaled one; a step with an inf gradient is
    skipped and the scale lowered."""
    model, batches = model_and_batches()
    plain, _ = stepped(model, batches[:1], Knobs(clip_grad_norm=1.0))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled, _ = stepped(model, batches[:1], Knobs(scaler=scaler, clip_grad_norm=1.0))
    torch.testing.assert_close(update(model, scaled), update(model, plain), rtol=1e-4, atol=1e-6)

    broken = copy.deepcopy(model)
    broken[0].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(broken.parameters(), lr=1.0)
    train_step(broken, batches[:1], Classification(), LOSS, optimizer, Knobs(scaler=scaler))
    assert update(model, broken).abs().sum() == 0  # skipped
    assert scaler.get_scale() < 2.0**10
