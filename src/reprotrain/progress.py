"""Progress: a bar on a terminal, plain periodic lines in CI logs."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, mode: str = "auto", lines: int = 10) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.total = mode, total
        self.every = max(1, total // lines)
        self.next_line = self.every
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}", refresh=False
            )
            self.bar.update(step - self.bar.n)
        elif self.mode == "lines" and (step >= self.next_line or step == self.total):
            self.next_line = step + self.every
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
