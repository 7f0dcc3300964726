"""Tensor-parallel workers as Ray actors (`--distributed-executor-backend ray`), across a cluster's nodes.

The engine joins the Ray cluster that is running (`ray start --head` on one node, `ray start
--address HEAD:6379` on the others; `ray.init(address="auto")`), or starts a local one when there is
none. One actor per rank is placed in a placement group (one bundle per rank: its CPU threads, and
a GPU on CUDA), packed onto as few nodes as fit. Each actor runs the same worker loop as a local
worker process (tp_worker.run_worker): the same ZMQ + msgspec step protocol, over tcp:// to this
process, and torch.distributed's rendezvous at rank 0's node. Ray itself only places and starts the
actors; no step goes through Ray's own (pickling) calls. docs/DISTRIBUTED.md has the multi-node recipe.

A dead actor (its node gone, its process killed) ends its `run` call: the executor sees that and
declares the engine dead, as for a local worker. When this process dies, Ray ends the actors it owns.
"""

from __future__ import annotations

import logging
import os
import socket

import msgspec
import zmq

from tokenmill.engine.executor.worker_group import WorkerGroupExecutor
from tokenmill.engine.executor.worker_messages import WorkerSpec

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0


class _RayWorker:
    """The actor's class (ray.remote is applied when the executor starts: Ray stays an optional
    dependency)."""

    def rendezvous_address(self) -> str:
        """tcp://this node's address:a free port, for torch.distributed's rendezvous (rank 0)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def run(self, spec_bytes: bytes) -> None:
        """Serve the engine's commands until it stops this worker (tp_worker.run_worker)."""
        from tokenmill.engine.executor.tp_worker import run_worker

        spec = msgspec.msgpack.decode(spec_bytes, type=WorkerSpec)
        logging.basicConfig(
            level=spec.log_level.upper(), format=f"%(levelname)s rank{spec.rank} %(name)s: %(message)s"
        )
        run_worker(spec)


class RayExecutor(WorkerGroupExecutor):
    _ray = None
    _started_ray = False
    _actors: list = []
    _loops: list = []
    _placement_group = None

    # -- Ray ------------------------------------------------------------------------------------

    def _ensure_ray(self):  # noqa: ANN202 - the ray module
        if self._ray is not None:
            return self._ray
        try:
            import ray
        except ImportError:
            raise ValueError(
                "distributed_executor_backend=ray needs Ray: pip install 'tokenmill[ray]' (or ray)"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
                logger.info("joined the running Ray cluster: %s", ray.cluster_resources())
            except ConnectionError:
                # No cluster: a local one, sized so that every rank's bundle fits.
                cores = os.cpu_count() or 1
                needed = self.size * self._torch_threads_per_rank()
                ray.init(num_cpus=max(cores, needed), include_dashboard=False, logging_level=logging.WARNING)
                self._started_ray = True
                logger.info("no Ray cluster running: started a local one (%d CPUs)", max(cores, needed))
        return ray

    def _create_actors(self) -> None:
        ray = self._ensure_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        threads = self._torch_threads_per_rank()
        on_gpu = self.config.device.startswith("cuda")
        bundle = {"CPU": threads, **({"GPU": 1} if on_gpu else {})}
        group = placement_group([bundle] * self.size, strategy="PACK")
        self._placement_group = group
        ray.get(group.ready(), timeout=120)
        actor_class = ray.remote(_RayWorker)
        self._actors = [
            actor_class.options(
                num_cpus=threads,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
            ).remote()
            for rank in range(self.size)
        ]

    # -- WorkerGroupExecutor --------------------------------------------------------------------

    def _bind(self, sock: zmq.Socket) -> str:
        host = self._ensure_ray().util.get_node_ip_address()
        sock.bind(f"tcp://{host}:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _dist_init_method(self) -> str:
        self._create_actors()
        return self._ray.get(self._actors[0].rendezvous_address.remote(), timeout=120)  # type: ignore[union-attr]

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        # Ray actors have no parent process to watch: Ray ends them when this process goes.
        self._loops = [
            actor.run.remote(msgspec.msgpack.encode(msgspec.structs.replace(spec, parent_pid=0)))
            for actor, spec in zip(self._actors, specs, strict=True)
        ]

    def _dead_worker(self, besides: int | None = None) -> str | None:
        ray = self._ray
        if not self._loops or ray is None:
            return None
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        for ref in done:
            rank = self._loops.index(ref)
            if rank == besides:
                continue
            try:
                ray.get(ref)
                return f"tensor-parallel rank {rank}'s Ray actor stopped serving"
            except Exception as exc:  # RayActorError and the like: what Ray says about the loss
                return f"tensor-parallel rank {rank}'s Ray actor died: {type(exc).__name__}: {str(exc)[:500]}"
        return None

    def _stop_workers(self) -> None:
        ray = self._ray
        if ray is None:
            return
        if self._loops and self._dead is None:
            ray.wait(self._loops, num_returns=len(self._loops), timeout=STOP_WAIT_S)
        for actor in self._actors:
            ray.kill(actor)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
        self._actors, self._loops = [], []
        if self._started_ray:
            ray.shutdown()
