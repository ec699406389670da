"""One thread per process runs the models (docs/ARCHITECTURE.md, "Threads").

torch's CPU build runs its kernels on libgomp (GNU OpenMP). Every thread that starts a parallel
region gets a team of its own, whose worker threads live as long as that thread does. Once a
process holds more OpenMP threads than it has CPUs, libgomp stops spinning at its barriers (its
throttled spin count is 100) and parks every thread on a futex at the end of every parallel
region, so each kernel of a forward pays a sleep and a wake-up. A process that loads its models
on one thread and runs them on another, or steps from whichever request thread asks, is in that
state on any machine where torch uses every core, and pays for it on every forward in context
switches.

So the models live on one thread: the engine's steps (`viasd.engine.Engine`), the loading,
packing and profiling of `viasd.llm.LLM`, the actors' forwards (`viasd.actors.rpc.InOrder`) and
the benchmark's baselines all run through `run` (blocking) or `executor()` (asyncio), and a call
made on the model thread itself runs in place. Work that must overlap a forward on purpose
(`overlap`'s drafting ahead in process) runs `Beside` it, on a thread of its own that ends with
the work, and its team with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Worker:
    """One thread that runs a kind of work one call after the other: `executor()` for asyncio
    (`loop.run_in_executor(worker.executor(), fn)`), `run` blocking (in place when called on it).
    Started on first use."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._ident: int | None = None  # its thread's, once started

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name, initializer=self._started)
            return self._executor

    def _started(self) -> None:
        self._ident = threading.get_ident()

    def on_thread(self) -> bool:
        """Whether the caller is this worker's thread."""
        return threading.get_ident() == self._ident

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on this worker's thread (in place when called there); its result or exception."""
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.executor().submit(fn, *args, **kwargs).result()


MODELS = Worker("viasd-model")  # the process's model thread


def executor() -> ThreadPoolExecutor:
    """The process's model thread as an executor (`loop.run_in_executor(executor(), fn)`)."""
    return MODELS.executor()


def on_model_thread() -> bool:
    """Whether the caller is the model thread."""
    return MODELS.on_thread()


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the model thread (in place when called there); its result or exception."""
    return MODELS.run(fn, *args, **kwargs)


class Beside:
    """fn(*args) on a new thread while the caller goes on (a forward of its own, say); `result()`
    waits for the thread to end and returns fn's result or raises its exception. The thread ends
    with fn, so its OpenMP team does not outlive the overlap."""

    def __init__(self, fn: Callable[..., T], *args):
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(fn, args), name="viasd-beside", daemon=True)
        self._thread.start()

    def _work(self, fn: Callable[..., T], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller by result()
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
