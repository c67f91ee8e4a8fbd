"""Re-planners for tests/router/test_membership_worker.py, importable by name in the driver's worker
process: the real one noting the pid it ran in, one that dies mid-plan, one that never answers."""

from __future__ import annotations

import os
import time
from typing import Any


def replan_noting_pid(cluster: Any, profiles: Any, plan: Any, options: Any) -> Any:
    from planner.replan import replan

    result = replan(cluster, profiles, plan, options)
    result.plan.stats["worker_pid"] = os.getpid()
    return result


def crash(*_: Any) -> Any:
    os._exit(7)


def hang(*_: Any) -> Any:
    time.sleep(120)
