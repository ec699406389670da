"""The process's model thread (viasd.model_thread): every forward runs on it, whoever asks."""

from __future__ import annotations

import asyncio
import threading

import psutil
import pytest
import torch
from conftest import save_tiny_pair

from viasd import model_thread
from viasd.config import parse_params
from viasd.engine import Engine
from viasd.runtime import LayerMask


def _model_thread_ident() -> int:
    return model_thread.run(threading.get_ident)


def test_run_hops_to_one_thread_runs_in_place_there_and_raises():
    ident = _model_thread_ident()
    assert ident != threading.get_ident()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(_model_thread_ident())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [ident] * 3
    # a call made on the model thread runs in place (a queued call there would wait for itself)
    assert model_thread.run(lambda: model_thread.run(threading.get_ident)) == ident
    with pytest.raises(ZeroDivisionError):
        model_thread.run(lambda: 1 / 0)


def _native_workers(before: set[int]) -> list[int]:
    """Threads of this process started since `before` (thread ids) that are neither Python
    threads nor named by the library that started them (gRPC, Ray: they name theirs): OpenMP
    workers, which inherit their parent's unnamed `comm`. Counted so, a thread that some other
    library happens to start meanwhile (pytest-xdist runs other tests' leftovers beside this
    one) does not pass for one."""
    python = {t.native_id for t in threading.enumerate()}
    unnamed = psutil.Process().name()[:15]  # (comm: 15 characters)

    def comm(tid: int) -> str | None:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:
            return None  # (not Linux, or gone: count it)

    new = {t.id for t in psutil.Process().threads()} - before - python
    return [t for t in new if comm(t) in (unnamed, None)]


def test_torch_work_from_many_threads_starts_one_openmp_team():
    """Each thread that runs a parallel region gets an OpenMP team whose workers live as long as
    it does; routed through the model thread, callers that stay alive add no team of their own."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1024, 1024)

        def work():  # a BLAS product and an ATen parallel_for, each a parallel region
            return (x @ x).sum() + torch.exp(x).sum()

        model_thread.run(lambda: torch.set_num_threads(2) or work())  # the model thread's team
        before = {t.id for t in psutil.Process().threads()}
        done, hold = threading.Barrier(4), threading.Event()

        def caller():
            model_thread.run(work)
            done.wait()
            hold.wait()  # alive, as a server's request threads are

        callers = [threading.Thread(target=caller) for _ in range(3)]
        for t in callers:
            t.start()
        done.wait(60)
        workers = _native_workers(before)
        hold.set()
        for t in callers:
            t.join(30)
        assert workers == []  # the callers started no OpenMP worker of their own
    finally:
        torch.set_num_threads(threads_before)


def test_every_forward_runs_on_the_model_thread_whoever_steps(tiny_pair, monkeypatch):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), max_batch=4)
    where: set[int] = set()
    for lm in (verifier, drafter):
        forward = lm.forward_batch

        def spy(*args, _forward=forward, **kwargs):
            where.add(threading.get_ident())
            return _forward(*args, **kwargs)

        monkeypatch.setattr(lm, "forward_batch", spy)
    callers = [
        threading.Thread(target=lambda m=m: list(engine.generate([5, 6, 7], parse_params(mode=m, max_tokens=8))))
        for m in ("ar", "sd", "via")
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join(120)
    handle = engine.submit([9, 10], parse_params(mode="sd", max_tokens=4))
    while not handle.finished:
        engine.step()  # driven from this thread
    assert where == {_model_thread_ident()}


def test_an_actor_s_calls_run_in_order_on_the_model_thread():
    from viasd.actors.rpc import InOrder

    async def main():
        work = InOrder("test")
        order: list[int] = []
        first, second = work.number(), work.number()
        late = work.enqueue(second, lambda: order.append(1) or threading.get_ident())  # waits for `first`
        early = work.enqueue(first, lambda: order.append(0) or threading.get_ident())
        idents = {await early, await late}
        work.shutdown()
        with pytest.raises(RuntimeError, match="shutting down"):
            await work.submit(threading.get_ident)
        return order, idents

    order, idents = asyncio.run(main())
    assert order == [0, 1] and idents == {_model_thread_ident()}
    assert _model_thread_ident() in idents  # the model thread goes on after one InOrder's shutdown


def test_actors_that_span_every_core_take_turns_on_the_node(tmp_path, monkeypatch):
    """`cores_lock`: a CPU actor whose threads cover every core holds the node's cores lock while
    each of its calls runs, so another process holding it (another actor) makes it wait; overlap's
    drafting ahead (`exclusive=False`) does not wait. GPU actors, actors with fewer threads than
    cores and tensor-parallel ranks (their collectives run at once) take no lock."""
    import subprocess
    import sys
    import tempfile
    import time

    from viasd.actors.rpc import InOrder, cores_lock

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cores_lock("cuda:0", 2, 1) is None and cores_lock("cpu", 1, 1) is None and cores_lock("cpu", 2, 2) is None
    lock = cores_lock("cpu", 2, 1)
    assert lock is not None and lock.lock_file.startswith(str(tmp_path))
    holder = subprocess.Popen(  # another actor of the node, in the middle of a forward
        [
            sys.executable,
            "-c",
            "import filelock, sys; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True);"
            " sys.stdin.readline(); lock.release()",
            lock.lock_file,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"

        async def main():
            work = InOrder("test", lock)
            # runs while the other holds it (bounded: a call that waited for the lock would hang here)
            beside = await asyncio.wait_for(work.submit(lambda: lock.is_locked, exclusive=False), 30)
            waiting = work.submit(lambda: (lock.is_locked, time.monotonic()))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # the other process holds the cores
            released = time.monotonic()
            holder.stdin.write("\n")
            holder.stdin.flush()
            held, ran = await asyncio.wait_for(waiting, 30)
            return beside, held, ran >= released

        beside, held, after_release = asyncio.run(main())
        assert beside is False and held is True and after_release
        assert not lock.is_locked  # released after the call
    finally:
        holder.kill()
        holder.wait()


def test_llm_loads_its_models_on_the_model_thread(tmp_path, monkeypatch):
    from viasd.llm import LLM
    from viasd.models import loader

    config = save_tiny_pair(tmp_path)
    where, load = [], loader.load_causal_lm

    def spy(*args, **kwargs):
        where.append(threading.get_ident())
        return load(*args, **kwargs)

    monkeypatch.setattr(loader, "load_causal_lm", spy)
    llm = LLM(config)
    assert where == [_model_thread_ident()] * 2  # the verifier and the drafter
    assert llm.complete([5, 6, 7], parse_params(mode="sd", max_tokens=4)).finish_reason == "length"


def test_drafting_ahead_leaves_no_thread_behind(tiny_pair, monkeypatch):
    """`overlap` drafts ahead beside the verifier's forward on a thread of its own that ends with
    the step: no second OpenMP team outlives it (the tokens are the reference's: test_proposers)."""
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), max_batch=2)
    beside, calls = model_thread.Beside, []
    monkeypatch.setattr(model_thread, "Beside", lambda *a: calls.append(1) or beside(*a))
    model_thread.run(lambda: None)  # (the model thread is up before counting)
    before = {t.ident for t in threading.enumerate()}
    engine.complete([5, 6, 7], parse_params(mode="sd", overlap=True, max_tokens=24, temperature=0))
    assert calls  # it did draft ahead
    assert {t.ident for t in threading.enumerate()} == before
