"""What the hot-path harnesses here share: Redis, a key prefix of their own and one GPU-free
worker pinned to core 0 (as `ampd bench overhead` places it); everything removed again on
the way out. Each harness moves itself to core 1 when it chooses: before starting a
gateway that should share that core with the load, or after one that should not."""

import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ampd.local_redis import LocalRedis, delete_prefix, ensure_redis, free_port
from ampd.processes import Child, spawn_sim_worker, wait_healthy


@dataclass
class Bench:
    worker: Child
    redis: LocalRedis
    prefix: str  # the Redis key prefix of this run
    state: Path  # a fresh folder for logs and outputs
    model: str  # the worker's served model

    @property
    def registry(self) -> list[str]:
        """The options that point a gateway (or the worker) at this Redis and prefix."""
        return _registry(self.redis.url, self.prefix)


def _registry(redis_url: str, prefix: str) -> list[str]:
    return ["--redis-url", redis_url, "--redis-prefix", prefix]


@contextmanager
def one_worker(name: str, *options: str) -> Iterator[Bench]:
    prefix = f"{name}-{uuid.uuid4().hex[:6]}"
    state = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    redis = ensure_redis("redis://127.0.0.1:6379/12", state / "redis")
    worker = spawn_sim_worker("worker", free_port(), ["--role", "both", *options, *_registry(redis.url, prefix)],
                              log=state / "worker.log", cpu=0)  # fmt: skip
    try:
        if wait_healthy([worker]):
            raise RuntimeError(f"the worker did not start: {state / 'worker.log'}")
        model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
        yield Bench(worker, redis, prefix, state, model)
    finally:
        worker.stop()
        delete_prefix(redis.url, prefix)
        redis.stop()
