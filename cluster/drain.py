"""Graceful drain of every Serve replica of the cluster, ending what is left with finish reason `abort`.

Serve's own graceful shutdown kills a replica after `graceful_shutdown_timeout_s`, cutting its
streams without a last message. `drain` does it the way the standalone server does
(`guard.Calls.drain`), in every replica at once, before Serve is shut down: an operator (SIGTERM
to `viasd serve`, or `viasd drain` in a pod's preStop hook) gives an order to the detached
`DrainControl` actor, for the cluster or one node; the watcher of every replica concerned
refuses new requests, lets the running ones finish for up to timeout_s, ends the rest with
`abort` and reports how many; `drain` returns once every concerned replica reported (or the
deadline passed). Replicas register when they start and unregister in their destructor, so the
caller knows whom to wait for; `reset` removes the actor, so that a later start serves again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress

import ray

from viasd.errors import InvalidParameterError

log = logging.getLogger("viasd.cluster.drain")

CONTROL_NAME = "viasd-drain-control"
NAMESPACE = "viasd"
ABORT_GRACE_S = 10.0  # after the drain timeout: time for aborted streams to send their last message


@ray.remote(num_cpus=0, max_restarts=0)
class DrainControl:
    """The cluster's drain orders: replicas wait on it, the operator gives them (for the whole
    cluster, or for the replicas of one node when that node's pod is going away)."""

    def __init__(self):
        self._orders: list[tuple[float, str | None]] = []  # (timeout_s, node IP or None: every node)
        self._new_order = asyncio.Condition()
        self._replicas: dict[str, str] = {}  # replica -> its node IP
        self._reports: dict[int, dict[str, int]] = {}  # order -> replica -> requests aborted

    def register(self, replica: str, node: str) -> None:
        self._replicas[replica] = node

    def unregister(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    async def wait(self, node: str, after: int) -> tuple[int, float]:
        """The first order numbered `after` or later that concerns `node`: (its number, timeout_s)."""
        async with self._new_order:
            while True:
                for i in range(after, len(self._orders)):
                    timeout_s, target = self._orders[i]
                    if target in (None, node):
                        return i, timeout_s
                after = len(self._orders)
                await self._new_order.wait()

    async def start(self, timeout_s: float, node: str | None = None) -> tuple[int, list[str]]:
        """Give a drain order; returns its number and the replicas it concerns."""
        async with self._new_order:
            self._orders.append((timeout_s, node))
            self._new_order.notify_all()
        concerned = sorted(r for r, n in self._replicas.items() if node in (None, n))
        return len(self._orders) - 1, concerned

    def report(self, order: int, replica: str, aborted: int) -> None:
        self._reports.setdefault(order, {})[replica] = aborted

    def status(self, order: int | None = None) -> dict:
        return {"replicas": dict(self._replicas), "reports": dict(self._reports.get(order, {}))}


def control():
    """The cluster's DrainControl (created on first use)."""
    return DrainControl.options(
        name=CONTROL_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


async def watch(replica: str, drain, registered: asyncio.Event | None = None, retry_s: float = 1.0) -> None:
    """A replica's watcher: register (then set `registered`), and for every drain order that
    concerns this replica's node run `drain(timeout_s)` (an async callable returning how many
    requests it aborted) and report. Runs until cancelled; a control actor that went away
    (`reset`) is looked up again. The replica serves only once `registered` is set: a drain ordered
    before would not wait for its report, and Serve's shutdown would cut its streams."""
    node = ray.util.get_node_ip_address()
    while True:
        after = 0
        try:
            ctl = control()
            await ctl.register.remote(replica, node)
            if registered is not None:
                registered.set()
            while True:
                order, timeout_s = await ctl.wait.remote(node, after)
                log.info("replica %s draining for up to %.0fs", replica, timeout_s)
                aborted = await drain(timeout_s)
                log.info("replica %s drained; %d request(s) aborted", replica, aborted)
                await ctl.report.remote(order, replica, aborted)
                after = order + 1
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            await asyncio.sleep(retry_s)  # reset, or not reachable yet: look it up again


async def unregister(replica: str) -> None:
    """Take a replica that is going away off the list (without creating a control actor)."""
    with suppress(ValueError, ray.exceptions.RayActorError):
        await ray.get_actor(CONTROL_NAME, namespace=NAMESPACE).unregister.remote(replica)


def drain(timeout_s: float, *, node: str | None = None, poll_s: float = 0.2) -> dict:
    """Drain every replica (or those on the node with IP `node`), blocking until each reported or
    the deadline passed: {"replicas", "reports" (replica -> requests aborted), "missing"}."""
    ctl = control()
    order, replicas = ray.get(ctl.start.remote(timeout_s, node))
    deadline = time.monotonic() + timeout_s + ABORT_GRACE_S + 5.0
    while True:
        status = ray.get(ctl.status.remote(order))
        missing = [r for r in replicas if r not in status["reports"] and r in status["replicas"]]
        if not missing or time.monotonic() > deadline:
            return {"replicas": replicas, "reports": status["reports"], "missing": missing}
        time.sleep(poll_s)


def reset() -> None:
    """Remove the control actor (after Serve shut down), so that a later start serves again."""
    with suppress(ValueError):  # none
        ray.kill(ray.get_actor(CONTROL_NAME, namespace=NAMESPACE))


def _this_node() -> str:
    """The IP of the Ray node this driver joined (the raylet's address, as replicas see it)."""
    me = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)


def main(address: str = "auto", timeout_s: float = 30.0, this_node: bool = False) -> int:
    """`viasd drain` (a Kubernetes preStop hook): join the running cluster at `address`, drain its
    replicas (only those on this machine's node with `this_node`), print the result as JSON;
    exit status 1 when a replica did not report."""
    if timeout_s < 0:
        raise InvalidParameterError("timeout_s", "must be >= 0")
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        result = drain(timeout_s, node=_this_node() if this_node else None)
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0 if not result["missing"] else 1
