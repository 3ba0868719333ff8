"""The console progress bar of a training run: a tqdm bar with loss, throughput, MFU and ETA.

The numbers come from the step records (`train/throughput.py`); notes such as the held-out loss
get lines of their own under the bar.
"""

from __future__ import annotations

import sys


class Progress:
    """A tqdm bar (stderr) with loss, throughput and ETA; silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, initial: int = 0):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def show(self, record: dict) -> None:
        if self.bar is not None:
            mfu_text = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
            self.bar.set_postfix_str(f"loss={record['loss']:.4f} tok/s={record['tokens_per_sec']:.0f} mfu={mfu_text}")

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
