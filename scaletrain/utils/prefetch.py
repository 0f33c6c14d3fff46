"""A bounded read-ahead over an iterator, in a thread (shared by the weight transports): the next item is produced
while the consumer works on the previous one, and at most ``depth`` items wait in between."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def prefetched(items: Iterable[T], depth: int = 1, name: str = "prefetch") -> Iterator[T]:
    """``items`` in order, produced by a thread up to ``depth`` items ahead of the consumer. The producer's error
    is raised in the consumer at the item where it happened; a consumer that stops early (or fails) stops the
    producer at its next item, and the producer thread has ended once this generator is closed."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if not _put(ready, (item, None), stop):
                    return
            _put(ready, (_END, None), stop)
        except BaseException as error:  # handed to the consumer, raised there
            _put(ready, (_END, error), stop)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _put(ready: queue.Queue, entry: tuple, stop: threading.Event) -> bool:
    """Put ``entry`` once there is room; False if the consumer stopped meanwhile."""
    while not stop.is_set():
        try:
            ready.put(entry, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
