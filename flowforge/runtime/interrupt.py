"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) without losing its work.

What and why
------------
A killed run loses everything since its last scheduled checkpoint, and Ctrl-C used to print a long traceback that
named no way on. :class:`StopSignals` turns the two signals into a request that the training loop reads at each step
boundary:

==========================================  ===========================================================================
when the signal arrives                     what happens
==========================================  ===========================================================================
before the loop is armed (setup, the        :class:`Interrupted` is raised at once: nothing was trained, the run
step-0 eval)                                directory is put back by the trainer's failure path
the first one while a step runs             the step finishes, a checkpoint of it is committed (as a scheduled one is),
                                            the run ends with :class:`Interrupted` (``graceful``)
a second one while finishing                :class:`Interrupted` is raised at once; a resume goes back to the last
                                            committed checkpoint
==========================================  ===========================================================================

Exit status: ``128 + signal number`` (the shell's convention): 130 for SIGINT, 143 for SIGTERM
(:data:`EXIT_CODES`). Under ``torchrun`` every rank gets the signal from the agent; :meth:`StopSignals.agreed` is a
collective (an all-reduce ``max`` of the signal number at the step boundary), so all ranks stop after the same step.
Handlers are installed only in the main thread (Python's rule) and the previous ones are put back on exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("flowforge")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODES = {int(s): 128 + int(s) for s in SIGNALS}
"""Signal number -> exit status (130 SIGINT, 143 SIGTERM)."""


class Interrupted(BaseException):
    """A run stopped by a signal. A ``BaseException`` (like ``KeyboardInterrupt``) so that ``except Exception``
    blocks on its way do not swallow it.

    Attributes:
        signum: the signal (``signal.SIGINT`` / ``signal.SIGTERM``).
        graceful: True when the current step finished and its checkpoint was committed; False when the run stopped
            at once (a second signal, or one before the first step).
        step: completed steps when it stopped (``None`` when not known: stopped at once).
        exit_code: ``128 + signum``.
    """

    def __init__(self, signum: int, *, graceful: bool, step: int | None = None):
        self.signum, self.graceful, self.step = int(signum), graceful, step
        self.exit_code = EXIT_CODES.get(self.signum, 128 + self.signum)
        done = f": finished step {step} and committed its checkpoint" if graceful else ": stopped at once"
        super().__init__(f"interrupted by {signal_name(signum)}{done}")


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; ``"signal 42"`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """SIGINT / SIGTERM handlers for the duration of a ``with`` block (see the module docstring).

    ``armed`` (set by the training loop once a step may be finished) decides what a first signal does: unarmed, it
    raises :class:`Interrupted` at once; armed, it records :attr:`signum` and the loop stops at the next step
    boundary. A second signal always raises at once. Outside the main thread the block installs nothing (the
    process's owner handles signals). Blocks may nest (the command line's around the trainer's): the outermost
    installs the handlers and restores the ones it found, and leaving it disarms.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.armed = False
        self._previous: dict[int, object] = {}
        self._depth = 0  # nested with-blocks entered and not left

    def __enter__(self) -> StopSignals:
        if self._depth == 0 and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        self.armed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None or not self.armed:
            self.signum = self.signum or signum
            raise Interrupted(signum, graceful=False)
        self.signum = signum
        # an acknowledgement at once: finishing a step can take minutes on a large model
        log.warning("%s received: finishing the current step and committing its checkpoint; send it again to stop "
                    "at once (a resume then goes back to the last committed checkpoint)", signal_name(signum))

    def agreed(self, distributed: bool) -> int | None:
        """The signal every rank stops for at this step boundary, or None to go on. With ``distributed`` a
        collective (every rank must call it): the maximum of the ranks' signal numbers, so one rank's signal stops
        them all after the same step."""
        mine = self.signum or 0
        if distributed:
            import torch  # here: the command line imports this module before it imports torch

            from flowforge.runtime.distributed import all_reduce_processes

            mine = int(all_reduce_processes(torch.tensor([mine], dtype=torch.int64), "max")[0])
        return mine or None
