"""The order waiting requests start in: the core's admission queue (:mod:`router.core`), drained.

First in, first out while routes are free: a request that cannot start now (every route KV-masked)
holds up those behind it, so a large request is not starved by small ones. One exception, for
fine-tuned tasks held by some nodes only (:mod:`router.task_placement`): such a request waits for
*its task's* holders, so it holds up only later requests of the same task; the others behind it,
which may run elsewhere, start. Pure: the caller passes how to start a request and which tasks are
restricted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from router.request import Request


def start_waiting(waiting: deque[Request], try_start: Callable[[Request], bool],
                  restricted: Callable[[str], bool]) -> None:  # fmt: skip
    """Start ``waiting``'s requests in order while ``try_start`` starts them (see the module doc);
    finished ones are dropped, started ones removed."""
    while waiting:
        request = waiting[0]
        if request.status.finished or try_start(request):
            waiting.popleft()
            continue
        if not restricted(request.params.task):
            return
        break
    else:
        return
    held_up = {waiting[0].params.task}  # the head waits for its task's holders: look past it
    for request in list(waiting)[1:]:
        task = request.params.task
        if request.status.finished:
            waiting.remove(request)
        elif task in held_up:
            continue
        elif try_start(request):
            waiting.remove(request)
        elif restricted(task):
            held_up.add(task)
        else:
            return
