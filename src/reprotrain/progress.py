"""Progress: a bar on a terminal, plain periodic lines in CI logs, and a line of its own for
each validation and for a stop (`note`). The rate shown is the one the run records
(throughput.samples_per_s: wall clock since the warm-up, checkpoints left out), so far."""

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

    def update(self, step: int, loss: float, samples_per_s: float | None) -> None:
        """`samples_per_s`: the run's throughput so far, as it records it at the end (wall
        clock since the warm-up, checkpoints left out); None during the warm-up."""
        rate = f"{samples_per_s:,.0f}" if samples_per_s is not None else "warming up"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=rate, refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.mode == "lines" and (step >= self.next_line or step == self.total):
            self.next_line = step + self.every
            unit = " samples/s" if samples_per_s is not None else ""
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  {rate}{unit}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        """A line of its own (a validation, a stop): above the bar, or among the lines."""
        if self.mode == "off":
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
