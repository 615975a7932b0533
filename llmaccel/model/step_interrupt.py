"""Ending the step in flight at a layer boundary, for a request that should not wait for it.

A step-granular scheduler makes a high-priority arrival wait for the step in flight: half a 64-row decode step
on average, several times a short prompt's own prefill. With --scheduling-policy priority the server raises this
flag when a request arrives that outranks the worst row of the step in flight (engine/priority_scheduling.py);
the forward pass checks it after every layer (the C++ decode stack too, through `flag`) and stops with
StepInterrupted. Nothing of the step is kept: no token is sampled and no request advances, so the next step
schedules the same tokens again, the newcomer first. The K/V the stopped step wrote lies in slots past every
request's computed tokens, which the next step writes again; blocks enter the prefix cache only after a step
completes, so no half-written block is ever shared.
"""

from __future__ import annotations

import numpy as np
import torch


class StepInterrupted(Exception):
    """The step stopped between two layers because its StepInterrupt was raised."""


class StepInterrupt:
    """A flag one thread raises and the engine thread's forward pass reads between layers."""

    def __init__(self) -> None:
        self._flag = np.zeros(1, dtype=np.int32)  # raised without torch: the engine thread owns every torch op
        self.flag = torch.from_numpy(self._flag)  # the same int32, as the decode stack reads it

    def raise_(self) -> None:
        self._flag[0] = 1

    def clear(self) -> None:
        self._flag[0] = 0

    @property
    def is_raised(self) -> bool:
        return bool(self._flag[0])

    def check(self) -> None:
        """Raise StepInterrupted if the flag is up (between two layers)."""
        if self._flag[0]:
            raise StepInterrupted
