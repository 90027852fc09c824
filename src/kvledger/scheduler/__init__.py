"""The request state machine and the continuous-batching scheduler: intake and safe points
(``scheduler.py``), batch policy and retraction (``policy.py``), stop checks (``stop.py``), sessions'
lifecycle (``sessions.py``) and the types that cross the executor seam (``output.py``)."""

from .output import ModelRunnerOutput, SamplingRow, ScheduledReq, SchedulerOutput
from .request import Req, ReqState
from .scheduler import PAUSE_MODES, Scheduler
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
