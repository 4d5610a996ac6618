"""Checkpoints by time (`checkpoint_every_s=S`): a save once S seconds have passed since the last.

The readers of such a run are granted at most `WINDOW` steps ahead of the steps the driver has
recorded (a sliding grant, as with `until_loss`). Once S seconds have passed since the last save
(or the start), the save step is the grant already given, the first step no reader may start yet:
the driver records the steps before it, the pause saves there (as a `checkpoint_every` pause does:
runtime/driver/pauses.py) and the grants slide on. A restart (`max_restarts`) so loses at most
about S seconds of training, plus the steps of one window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from runtime.driver.pauses import Pauses

WINDOW = 4  # steps the readers may run ahead of the recorded steps


@dataclass
class TimedPauses(Pauses):
    every_s: float | None = None
    timed: int | None = None  # the step of the timed save to come (None: not due yet)
    limit: int | None = None  # the last step limit given to the readers
    last_save: float = 0.0  # time.monotonic() of the last save (or of the start)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_save = time.monotonic()

    def next_pause(self, step: int) -> int | None:
        base = super().next_pause(step)
        if self.every_s is None:
            return base
        waited = time.monotonic() - self.last_save
        if self.timed is None and self.limit is not None and waited >= self.every_s:
            self.timed = max(self.limit, step + 1)  # no reader is past the limit it was given
        limit = self.timed if self.timed is not None else step + WINDOW
        if self.end is not None and limit >= self.end:
            self.timed = None if self.timed is not None and self.timed >= self.end else self.timed
            return base
        self.limit = limit
        return limit if base is None else min(base, limit)

    def due(self, step: int) -> bool:
        return super().due(step) or (self.timed is not None and step == self.timed and step > self.start)

    def pause(self, step: int, history: Any, tel: Any) -> None:
        super().pause(step, history, tel)
        if self.timed == step:
            self.save(step)
            self.timed = None

    def save(self, step: int) -> Any:
        path = super().save(step)
        if path is not None:
            self.last_save = time.monotonic()
        return path
