"""``python -m fedistill.flower supernode [--poll-interval S] <flower-supernode options>``: Flower's SuperNode,
polling the SuperLink faster while a run is active.

A Flower 1.41 SuperNode asks the SuperLink for a message, and when there is none sleeps 3 s
(``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``, no option or environment variable sets
it); while its ClientApp works it checks for the reply every 0.5 s. A client that has sent its reply
asks again at once, finds nothing (the server is still waiting for the other clients and aggregating)
and sleeps 3 s: the slowest client of every round therefore receives the next round's message about
3 s late, whatever the ClientApp costs, so no deployment round is shorter than about 3 s.

A message's content (its arrays) travels as separate objects after the message itself, and whoever
pulls a message whose objects are not all there yet waits 1 s before asking again (doubling to 10 s:
``pull_objects`` in ``flwr/supercore/inflatable/inflatable_utils.py``). With a process per message this
never showed; once the rest is fast, the SuperNode fetching the server's message and the ServerApp
fetching a reply often arrive that early and lose a whole second.

This command runs the unchanged ``flower-supernode`` (same options, same protocol) with these waits
shortened: for ``--fast-window`` seconds after its last message (a run is active) the SuperNode polls
every ``--poll-interval`` seconds instead of 3, it checks for the ClientApp's reply at the same pace
instead of every 0.5 s, and it asks again for missing objects after 0.01 s (doubling to 0.1 s). An idle
SuperNode returns to Flower's 3 s, so an idle federation loads its SuperLink no more than before.
fedistill's ServerApp shortens its own object pulls the same way (:func:`quicker_object_pulls`).
The shortening replaces names in Flower's modules (``time``, two message functions, ``pull_objects``); it
is made only for the flwr version it was written against (1.41) and otherwise refused with a warning,
Flower then running as it ships.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import sys
import time
import types
from typing import Any, Callable

PATCHED_FLWR = "1.41."
IDLE_SLEEP = 3  # flwr 1.41's sleep after an empty pull
# Missing objects of a message: ask again after 0.01 s, doubling to 0.1 s, until Flower's overall limit
# (PULL_MAX_TIME, 2 h) rather than after 500 tries (which at this pace would be about 4 minutes).
QUICK_PULL = {"initial_backoff": 0.01, "backoff_cap": 0.1, "max_tries_per_object": None}


def patchable_flwr() -> str | None:
    """The installed flwr version if these shortenings were written for it, else None."""
    version = importlib.metadata.version("flwr")
    return version if version.startswith(PATCHED_FLWR) else None


def quicker_object_pulls(module: types.ModuleType) -> bool:
    """Make ``module``'s ``pull_objects`` retry a missing object after 0.01 s (doubling to 0.1 s) instead
    of 1 s (doubling to 10 s). Returns whether it did (flwr 1.41 and a module that has ``pull_objects``)."""
    current = getattr(module, "pull_objects", None)
    if current is None or patchable_flwr() is None:
        return False
    if not getattr(current, "fedistill_quick", False):
        quick = functools.partial(current, **QUICK_PULL)
        quick.fedistill_quick = True  # type: ignore[attr-defined]
        module.pull_objects = quick  # type: ignore[attr-defined]
    return True


class _FastTime(types.ModuleType):
    """``time`` for ``start_client_internal``: the same functions, shorter sleeps while a run is active."""

    def __init__(self, poll_interval: float, fast_window: float) -> None:
        super().__init__("time")
        self.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
        self.poll_interval = poll_interval
        self.fast_window = fast_window
        self.last_activity = float("-inf")
        self.sleep = self._sleep  # type: ignore[method-assign]

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def _sleep(self, seconds: float) -> None:
        if seconds == IDLE_SLEEP and time.monotonic() - self.last_activity >= self.fast_window:
            time.sleep(seconds)  # idle: Flower's own pace
        else:
            time.sleep(min(seconds, self.poll_interval))


def _recording(fn: Callable[..., Any], clock: _FastTime, when: Callable[[Any], bool]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if when(result):
            clock.touch()
        return result

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def shorten_polling(poll_interval: float, fast_window: float) -> _FastTime | None:
    """Patch flwr 1.41's SuperNode loop in this process; returns the clock, or None where it was refused."""
    import flwr.supernode.start_client_internal as loop

    if isinstance(getattr(loop, "time", None), _FastTime):
        return None  # already shortened in this process
    needed = ("time", "_pull_and_store_message", "_push_messages", "start_client_internal", "pull_objects")
    if patchable_flwr() is None or not all(hasattr(loop, name) for name in needed) or loop.time is not time:
        print(
            f"[fedistill] warning: the poll shortening is written for flwr {PATCHED_FLWR}x, this is flwr "
            f"{importlib.metadata.version('flwr')}; the SuperNode runs unchanged (3 s between polls)",
            file=sys.stderr,
            flush=True,
        )
        return None
    clock = _FastTime(poll_interval, fast_window)
    loop._pull_and_store_message = _recording(loop._pull_and_store_message, clock, lambda run_id: run_id is not None)
    loop._push_messages = _recording(loop._push_messages, clock, lambda _: True)
    loop.time = clock
    quicker_object_pulls(loop)
    return clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedistill.flower supernode",
        description="flower-supernode, polling the SuperLink every --poll-interval s while a run is active "
        "(every other option is flower-supernode's: see flower-supernode --help)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.1, help="seconds between polls while a run is active (0.1; Flower: 3)")
    parser.add_argument("--fast-window", type=float, default=30.0, help="seconds after the last message during which to poll fast (30)")
    ours, rest = parser.parse_known_args(argv)
    if not 0 < ours.poll_interval <= IDLE_SLEEP:
        parser.error(f"--poll-interval must be in (0, {IDLE_SLEEP}] seconds")
    shorten_polling(ours.poll_interval, ours.fast_window)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0
