"""A step running in its own thread, with one event per key (a target) that its readers wait for: the
NVMe optimizer step behind the next forward (engine/offload/optimizer_swap.py, [Note: the step behind the
next forward])."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class StepThread:
    """run(done) in a thread; run calls done(key) when key's work is finished. Every key counts as
    finished once run returns or raises; `error` is what it raised, for the waiters to raise again."""

    def __init__(self, run: Callable[[Callable[[int], None]], None], keys: Iterable[int]) -> None:
        self._done = {key: threading.Event() for key in keys}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(run,), name="zero-engine-nvme-step", daemon=True)
        self._thread.start()

    def _main(self, run: Callable[[Callable[[int], None]], None]) -> None:
        try:
            run(lambda key: self._done[key].set())
        except BaseException as err:  # noqa: BLE001 (raised again by the thread that waits for it)
            self.error = err
        finally:
            for event in self._done.values():
                event.set()

    def finished(self, key: int) -> bool:
        """Whether key's work is done (a key the step does not have: yes)."""
        event = self._done.get(key)
        return event is None or event.is_set()

    def wait_for(self, key: int) -> None:
        """Until key's work is done (or the step failed: see `error`)."""
        event = self._done.get(key)
        if event is not None:
            event.wait()

    def join(self) -> BaseException | None:
        """Until the whole step is done; its error, or None."""
        self._thread.join()
        return self.error
