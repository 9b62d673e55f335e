"""Evaluation sweeps over many model replicas: Ray actors, one replica each (issue 26, item 3).

An evaluation harness splits its work into batches whose results depend only on the batch (its
problems and its seed); `RayRunner.map(fn, batches)` runs `fn(backend, batch)` on the replicas and
returns the results in the batches' order, so a sweep on N replicas gives the serial run's report
(bit for bit at the same torch thread count: CPU float sums depend on how many threads split them,
so a serial run to compare with runs at `threads`, one by default).
We never build our own distributed runtime: Ray places the actors (one per GPU on a cluster, one
per `threads` CPUs here), we only hand out batches, count finished problems for one progress bar,
and give a batch whose replica died to another replica.

    with RayRunner("toy-reasoner:small", address="auto", replicas=2) as runner:
        report = evaluate_cot_exit(engine, "toy-reasoner:small", 20, 10, 10, runner=runner)

`address`: "auto" (the cluster named by RAY_ADDRESS, else a new local one on this machine's CPUs)
or a cluster's "host:port" / "ray://host:port", which must answer within `connect_timeout_s`; its
nodes need thoughtscope installed (the replicas import it) and the model in their local caches.
Ray is an optional extra (`pip install thoughtscope[ray]`), imported only when a runner starts.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from thoughtscope import checks
from thoughtscope.errors import BadInputError, ClusterError, ThoughtscopeError

# what a replica's process must see as the driver does: nothing fetched from a hub, one set of threads
PASSED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "THOUGHTSCOPE_CACHE")


def import_ray() -> Any:
    try:
        import ray
    except ModuleNotFoundError as err:
        raise BadInputError("--ray needs Ray: pip install 'thoughtscope[ray]' (or pip install ray)") from err
    return ray


def host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "ray://host:port"; the port defaults to Ray's (6379, client 10001)."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host:
        host, port = rest.rstrip("/"), ("10001" if address.startswith("ray://") else "6379")
    try:
        return host.strip("[]"), int(port)
    except ValueError as err:
        raise BadInputError(f"--ray takes auto or a cluster address such as 10.0.0.5:6379 or ray://head:10001; "
                            f"got {address!r}") from err


def check_reachable(address: str, timeout_s: float) -> None:
    """Fail within `timeout_s` when nothing listens at `address` (ray.init itself would wait far longer)."""
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as err:
        raise ClusterError(f"no Ray cluster answered at {address} within {timeout_s:g} s ({err.__class__.__name__}: "
                           f"{err}): start one there with `ray start --head`, or use --ray auto for a local "
                           "cluster on this machine") from None


class Replica:
    """One Ray actor's model: loaded once, then `run(fn, batch)` for every batch handed to it."""

    def __init__(self, model: str, threads: int, env: dict[str, str]):
        os.environ.update(env)
        import torch

        torch.set_num_threads(threads)
        from probes.backend import open_backend

        self.backend = open_backend(model)

    def ready(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[[Any, Any], Any], batch: Any) -> Any:
        return fn(self.backend, batch)


class RayRunner:
    """`replicas` Ray actors each holding `model` (`threads` CPUs, or one GPU when the cluster has GPUs).

    `map` hands batches to idle replicas; a replica that dies (its node lost, `ray.kill`) is dropped and
    its batch re-runs on another, so no problem is lost; only when no replica is left does it raise
    `ClusterError`. `lost` (the dead replicas) and `reruns` (the batches run again) say what happened.
    """

    def __init__(self, model: str, address: str = "auto", replicas: int | None = None, *, threads: int = 1,
                 connect_timeout_s: float = 5.0, start_timeout_s: float = 600.0):
        self.model = model
        self.address = address
        self.replicas = checks.integer("--replicas", replicas, low=1, none_ok=True)
        self.threads = checks.integer("threads per replica", threads, low=1)
        self.connect_timeout_s = float(checks.number("the connect timeout", connect_timeout_s, low=0, low_open=True))
        self.start_timeout_s = float(start_timeout_s)
        self.actors: list[Any] = []
        self.lost: list[Any] = []
        self.reruns = 0
        self._started_cluster = False
        self._ray: Any = None

    # ----- the cluster and the replicas

    def start(self) -> "RayRunner":
        if self.actors:  # started already (`ray_runner` starts it before the command enters its `with`)
            return self
        ray = self._ray = import_ray()
        if self.address not in ("auto", "local"):  # checked even when this process holds a cluster already
            check_reachable(self.address, self.connect_timeout_s)
        if not ray.is_initialized():
            self._connect(ray)
        gpus = float(ray.cluster_resources().get("GPU", 0))
        per_actor = {"num_gpus": 1} if gpus >= 1 else {"num_cpus": self.threads}
        available = ray.available_resources()
        fits = int(available.get("GPU", 0)) if gpus >= 1 else int(available.get("CPU", 0) // self.threads)
        unit = "GPU" if gpus >= 1 else f"{self.threads} CPU{'s' if self.threads > 1 else ''}"
        if fits < 1 or (self.replicas is not None and self.replicas > fits):
            raise ClusterError(f"{self.replicas or 1} replica(s) of {unit} each asked for, but the Ray cluster has "
                               f"room for {fits} now (free: {_resources(available)}): give --replicas {max(1, fits)} "
                               "or fewer, or add nodes to the cluster")
        n = self.replicas or fits
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        actor = ray.remote(**per_actor)(Replica)
        self.actors = [actor.remote(self.model, self.threads, env) for _ in range(n)]
        try:
            ray.get([a.ready.remote() for a in self.actors], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise ClusterError(f"the {n} replicas of {self.model} did not load within {self.start_timeout_s:g} s") \
                from None
        except ray.exceptions.RayActorError as err:
            self.close()
            raise _cause(err) or ClusterError(f"a replica of {self.model} failed to load: {err}") from None
        return self

    def _connect(self, ray: Any) -> None:
        address = os.environ.get("RAY_ADDRESS") if self.address == "auto" else self.address
        options = dict(log_to_driver=False, include_dashboard=False)  # stdout stays the command's (--json)
        if address and address not in ("auto", "local"):
            if address != self.address:  # RAY_ADDRESS (an explicit address was checked by start)
                check_reachable(address, self.connect_timeout_s)
            # something listens there; Ray's own wait for its GCS (a minute by default) is cut to ours
            wait, os.environ["RAY_gcs_server_port_wait_time_s"] = (os.environ.get("RAY_gcs_server_port_wait_time_s"),
                                                                   str(max(1, round(self.connect_timeout_s))))
            try:
                ray.init(address=address, **options)
            except Exception as err:  # Ray raises ConnectionError or RuntimeError with a page of its logs
                raise ClusterError(f"no Ray cluster answered at {address} within {self.connect_timeout_s:g} s "
                                   f"(something listens there, but Ray could not connect: {str(err).splitlines()[0]}): "
                                   "start one there with `ray start --head`, or use --ray auto for a local cluster "
                                   "on this machine") from None
            finally:
                if wait is None:
                    os.environ.pop("RAY_gcs_server_port_wait_time_s", None)
                else:
                    os.environ["RAY_gcs_server_port_wait_time_s"] = wait
        else:
            ray.init(num_cpus=os.cpu_count() or 1, **options)
        self._started_cluster = True

    def close(self) -> None:
        ray = self._ray
        if ray is None:
            return
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._started_cluster and ray.is_initialized():
            ray.shutdown()
        self._started_cluster = False

    def __enter__(self) -> "RayRunner":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- the work

    def map(self, fn: Callable[[Any, Any], Any], batches: Sequence[Any], *, weights: Sequence[int] | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> list[Any]:
        """[fn(replica's backend, batch) for batch in batches], the batches spread over the replicas.

        `weights`: problems per batch, so `on_progress(done, total)` counts problems across all replicas
        (one bar). A batch whose replica dies runs again on another; an error the batch itself raises
        (a `ThoughtscopeError` from the method) is raised here as it is.
        """
        ray = self._ray
        if ray is None or not self.actors:
            raise ClusterError("the Ray runner has no replicas: use it as `with RayRunner(...) as runner:`")
        weights = list(weights) if weights is not None else [1] * len(batches)
        total, done = sum(weights), 0
        results: list[Any] = [None] * len(batches)
        pending = deque(range(len(batches)))
        running: dict[Any, tuple[int, Any]] = {}
        idle = list(self.actors)
        fn_ref = ray.put(fn)  # shipped once, not with every batch
        try:
            while pending or running:
                while pending and idle:
                    i, actor = pending.popleft(), idle.pop(0)
                    running[actor.run.remote(fn_ref, batches[i])] = (i, actor)
                if not running:
                    raise ClusterError(f"every replica of {self.model} died ({len(self.lost)} lost); "
                                       f"{len(pending)} batches were not run")
                ready, _ = ray.wait(list(running), num_returns=1)
                i, actor = running.pop(ready[0])
                try:
                    results[i] = ray.get(ready[0])
                except ray.exceptions.RayActorError:
                    self._drop(actor, idle)
                    pending.appendleft(i)
                    self.reruns += 1
                    continue
                except ray.exceptions.RayTaskError as err:
                    raise _cause(err) or err from None
                idle.append(actor)
                done += weights[i]
                if on_progress:
                    on_progress(done, total)
        finally:
            for ref in running:  # a Stop raised by on_progress, or an error: nothing left running
                ray.cancel(ref, force=False)
        return results

    def _drop(self, actor: Any, idle: list[Any]) -> None:
        if actor in self.actors:
            self.actors.remove(actor)
            self.lost.append(actor)
        if actor in idle:
            idle.remove(actor)

    def describe(self) -> dict[str, Any]:
        """What the provenance of a sweep records about where it ran (the results do not depend on it)."""
        return {"ray": self.address, "replicas": len(self.actors) + len(self.lost), "threads": self.threads,
                "lost_replicas": len(self.lost), "reruns": self.reruns}


def _cause(err: Any) -> ThoughtscopeError | None:
    """The project error a replica raised (Ray wraps it), so the user sees its message."""
    cause = getattr(err, "cause", None)
    while cause is not None and not isinstance(cause, ThoughtscopeError):
        cause = getattr(cause, "cause", None) or getattr(cause, "__cause__", None)
    return cause


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU")) or "none"

