"""The request state machine and the continuous-batching scheduler: safe points, the one release path
and the step's two halves (``scheduler.py``), intake (``intake.py``), batch policy and retraction
(``policy.py``), the batch's rows (``rows.py``), a step's results (``results.py``), overlap's steps in
flight (``overlap.py``), the books (``books.py``), pausing (``pause.py``), stop checks (``stop.py``),
sessions' lifecycle (``sessions.py``) and the types that cross the executor seam (``output.py``)."""

from .output import ModelRunnerOutput, SamplingRow, ScheduledReq, SchedulerOutput
from .pause import PAUSE_MODES
from .request import Req, ReqState
from .scheduler import Scheduler
from .sessions import SessionManager

__all__ = [
    "PAUSE_MODES",
    "ModelRunnerOutput",
    "Req",
    "ReqState",
    "SamplingRow",
    "ScheduledReq",
    "Scheduler",
    "SchedulerOutput",
    "SessionManager",
]
