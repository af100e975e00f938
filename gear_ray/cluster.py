"""Start gear on a running Ray cluster, find it from tasks and actors, stop it (see gear_ray's docstring)."""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gear_ray.actors import STOP_TIMEOUT_S, Registry, ShardDaemon
from gear_ray.config import config_document, select_nodes

log = logging.getLogger(__name__)

DEFAULT_NAME = "gear"
DEFAULT_PORT = 8000
DEFAULT_CHECKPOINT_ROOT = "/var/tmp/gear-ray"  # per node: <root>/<name>/<host>; survives reboots
DEFAULT_MAX_RESTARTS = 10


def _registry_name(name: str) -> str:
    return f"gear_ray.{name}"


def _daemon_name(name: str, node_id: str) -> str:
    return f"gear_ray.{name}.{node_id}"


class GearCluster:
    """A gear deployment on Ray: one daemon actor per chosen node and the registry that lists them.

    The object ``start`` returns holds the actors' creating handles. A deployment that is not detached lives
    until ``stop()`` or until its driver exits, which drains it first (an ``atexit`` hook): Ray would otherwise
    end the actors, and with them the daemons, without their final checkpoints.
    """

    def __init__(self, name: str, namespace: str | None = None, owned: list[Any] | None = None):
        import ray

        self.name = name
        self.namespace = namespace
        self._owned = owned or []  # the creating handles (they keep non-detached actors alive)
        try:
            self.registry = ray.get_actor(_registry_name(name), namespace=namespace)
        except ValueError as exc:
            raise LookupError(f"no gear deployment named {name!r} runs on this Ray cluster "
                              "(gear_ray.start() makes one)") from exc

    def node_ids(self) -> list[str]:
        """The nodes that have a daemon, in shard order."""
        import ray

        return ray.get(self.registry.expected.remote())

    def shards(self) -> list[dict[str, Any]]:
        """What each daemon registered: address, port, pid, node_id, state_dir, starts (shard order)."""
        import ray

        return ray.get(self.registry.shards.remote())

    def addresses(self, timeout_s: float = 60.0) -> list[str]:
        """The shard list, ``["ip:port", ...]``, the same order for every caller: every node's daemon, waiting up
        to ``timeout_s`` for those not registered yet (starting, or a registry Ray restarted).

        Raises:
          TimeoutError: naming the nodes whose daemon has not registered.
        """
        return self.wait(timeout_s)

    def daemon(self, node_id: str) -> Any:
        """The actor handle of a node's daemon."""
        import ray

        return ray.get_actor(_daemon_name(self.name, node_id), namespace=self.namespace)

    def client(self, **kwargs: Any) -> Any:
        """A gear client over every shard (``gear_client.Client(addresses, **kwargs)``).

        Writers and inserts go to the daemon of the caller's own node (same host identity), sampling
        covers every shard with global semantics (docs/SHARDING.md).
        """
        import gear_client

        return gear_client.Client(self.addresses(), **kwargs)

    def wait(self, timeout_s: float = 120.0) -> list[str]:
        """Wait until every node's daemon has registered; the shard list.

        Raises:
          TimeoutError: naming the nodes whose daemon has not registered.
        """
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                shards = self.shards()
                missing = [n for n in self.node_ids() if n not in {s["node_id"] for s in shards}]
            except ray.exceptions.RayActorError as exc:  # the registry is restarting
                shards, missing = [], [f"all (the registry: {type(exc).__name__})"]
            if not missing:
                return [s["address"] for s in shards]
            if time.monotonic() > deadline:
                raise TimeoutError(f"gear daemons of node(s) {missing} did not register within {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Drain every daemon (SIGTERM: final checkpoints), then end the actors and the registry. Idempotent."""
        import ray

        try:
            node_ids = self.node_ids()
        except ray.exceptions.RayActorError:
            return  # stopped already
        handles = []
        for node_id in node_ids:
            try:
                handles.append(self.daemon(node_id))
            except ValueError:
                continue  # never started (or already gone)
        results = [h.stop.remote(timeout_s) for h in handles]
        for handle, result in zip(handles, results, strict=True):
            try:
                ray.get(result, timeout=timeout_s + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # an actor already dead has no daemon left to drain
            ray.kill(handle, no_restart=True)
        ray.kill(self.registry, no_restart=True)
        self._owned = []
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """The driver exits: drain the daemons it started while Ray is still connected."""
        import ray

        if not ray.is_initialized():
            return
        try:
            self.stop()
        except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
            log.warning("gear_ray: draining deployment %r at exit failed: %s", self.name, exc)


def start(config: str | Path | Mapping[str, Any], *, name: str = DEFAULT_NAME, port: int = DEFAULT_PORT,
          node_ids: Iterable[str] | None = None, resource: str | None = None, labels: Mapping[str, str] | None = None,
          checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT, max_restarts: int = DEFAULT_MAX_RESTARTS,
          detached: bool = False, namespace: str | None = None, actor_options: Mapping[str, Any] | None = None,
          log_level: str = "INFO", timeout_s: float = 900.0) -> GearCluster:
    """Start one gear daemon on every chosen node of the running Ray cluster; each is a shard of every table.

    Args:
      config: the daemons' configuration (a TOML path, TOML text or the parsed dict; the gear-server schema),
        the same tables on every node. Its ``port`` and ``[checkpoint] dir`` are set per node.
      name: the deployment's name (its registry actor is ``gear_ray.<name>``).
      port: the port every daemon binds (0: a free port per node, kept across restarts).
      node_ids: these nodes; else the nodes with ``resource``; else those whose labels include ``labels``;
        else every node with GPUs.
      checkpoint_root: on each node, checkpoints go to ``<checkpoint_root>/<name>/<host>/checkpoints``
        (``<host>``: ``GEAR_HOST_ID`` when set, else the host name).
      max_restarts: how often Ray restarts a node's daemon actor after its daemon died (-1: always).
      detached: the actors outlive this driver (stop them with ``gear_ray.attach(name).stop()``).
      namespace: the Ray namespace of the actors (default: the job's).
      actor_options: extra ``.options()`` for the daemon actors (e.g. ``{"num_cpus": 4}``; default 0 CPUs).
      timeout_s: how long to wait for every daemon to serve (restores of large checkpoints take minutes).

    Returns:
      The GearCluster, every daemon serving. Unless ``detached``, it lives until ``stop()`` or the driver's
      exit, which drains it.

    Raises:
      ConfigError: the configuration is invalid (checked before any actor starts).
      ValueError: no node matches, or a deployment of that name runs already.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    document = config_document(config)
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    chosen = select_nodes(ray.nodes(), node_ids=node_ids, resource=resource, labels=labels)
    try:
        ray.get_actor(_registry_name(name), namespace=namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"a gear deployment named {name!r} runs already (gear_ray.attach({name!r}).stop() ends it)")
    lifetime = {"lifetime": "detached"} if detached else {}
    registry = ray.remote(Registry).options(name=_registry_name(name), namespace=namespace, num_cpus=0,
                                            max_concurrency=64, max_restarts=-1, **lifetime).remote(name, document,
                                                                                                    chosen)
    ray.get(registry.expected.remote())
    options = {"num_cpus": 0, **(actor_options or {})}
    daemon_class = ray.remote(ShardDaemon)
    actors = []
    for node_id in chosen:
        actors.append(daemon_class.options(
            name=_daemon_name(name, node_id), namespace=namespace, max_restarts=max_restarts,
            max_task_retries=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            **lifetime, **options).remote(name, _registry_name(name), namespace, int(port), checkpoint_root,
                                          log_level))
    cluster = GearCluster(name, namespace, owned=[registry, *actors])
    if not detached:
        atexit.register(cluster._stop_at_exit)  # runs before ray.shutdown's own hook (registered earlier)
    try:
        ray.get([a.info.remote() for a in actors], timeout=timeout_s)
    except BaseException:
        cluster.stop(timeout_s=60)
        raise
    return cluster


def attach(name: str = DEFAULT_NAME, namespace: str | None = None) -> GearCluster:
    """The deployment ``name`` started earlier (from any driver, task or actor of the cluster).

    Raises:
      LookupError: no deployment of that name runs.
    """
    return GearCluster(name, namespace)


def addresses(name: str = DEFAULT_NAME, namespace: str | None = None, timeout_s: float = 60.0) -> list[str]:
    """The shard list of deployment ``name`` (for datasets: ``TrajectoryDataset(addresses(), ...)``); see
    ``GearCluster.addresses``."""
    return attach(name, namespace).addresses(timeout_s)


def client(name: str = DEFAULT_NAME, namespace: str | None = None, **kwargs: Any) -> Any:
    """A gear client over every shard of deployment ``name``, its inserts going to the caller's own node's
    daemon (see ``GearCluster.client``)."""
    return attach(name, namespace).client(**kwargs)
