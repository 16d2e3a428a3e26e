"""What redis-py's asyncio command path costs the gateway, against the least a client can do
and against the request path's own connection (gateway.state.redis_channel).

A one-off harness, not part of the package. A 40-argument script call, 5,000 times one at
a time and 1,000 pipelines of 16, three rounds each way, through redis-py 8 on the
gateway's own connection class (`gateway.state.redis_batch.PackedConnection`, hiredis' packer),
through a minimal client - an asyncio protocol writing hiredis-packed commands and
parsing replies with hiredis' reader, a queue of futures between them - and through
`gateway.state.redis_channel.RedisChannel`, which is that and what the gateway needs of
redis-py besides (reconnection, replies shaped as redis-py shapes them). CPU (user +
system, this process only) and wall time per call.

    taskset -c 1 .venv/bin/python bench/studies/overhead_hot_path/redis_client.py

Output of the run behind the overhead study: bench/results/overhead/ab/redis_channel/client_alone.txt.
"""

import asyncio
import collections
import resource
import time

import hiredis
import redis.asyncio as aioredis
import uvloop

from gateway.state.redis_batch import PackedConnection
from gateway.state.redis_channel import RedisChannel

SCRIPT = "return {ARGV[1], redis.call('GET', KEYS[1])}"
ARGS = [f"a{i}" for i in range(40)]
DB = 9


class Minimal(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            self.waiting.popleft().set_result(reply)

    def call(self, *args: object) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.transport.write(hiredis.pack_command(args))
        self.waiting.append(future)
        return future


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main() -> None:
    pool = aioredis.ConnectionPool(host="127.0.0.1", port=6379, db=DB, connection_class=PackedConnection)
    client = aioredis.Redis(connection_pool=pool)
    sha = await client.script_load(SCRIPT)
    _, minimal = await asyncio.get_running_loop().create_connection(Minimal, "127.0.0.1", 6379)
    await minimal.call("SELECT", DB)
    channel = RedisChannel(client)
    command = (("EVALSHA", sha, 1, "k", *ARGS), {})
    calls, pipelines, size = 5000, 1000, 16
    for _ in range(3):
        c0, w0 = cpu(), time.perf_counter()
        for _ in range(calls):
            await client.execute_command("EVALSHA", sha, 1, "k", *ARGS)
        c1, w1 = cpu(), time.perf_counter()
        for _ in range(calls):
            await minimal.call("EVALSHA", sha, 1, "k", *ARGS)
        c2, w2 = cpu(), time.perf_counter()
        for _ in range(calls):
            await channel.send([command])
        c3, w3 = cpu(), time.perf_counter()
        us = [x / calls * 1e6 for x in (c1 - c0, w1 - w0, c2 - c1, w2 - w1, c3 - c2, w3 - w2)]
        print(f"one at a time: redis-py {us[0]:.0f} us CPU, {us[1]:.0f} us wall; "
              f"minimal {us[2]:.0f} us CPU, {us[3]:.0f} us wall; "
              f"channel {us[4]:.0f} us CPU, {us[5]:.0f} us wall", flush=True)  # fmt: skip
    for _ in range(3):
        c0 = cpu()
        for _ in range(pipelines):
            pipe = client.pipeline(transaction=False)
            for _ in range(size):
                pipe.execute_command("EVALSHA", sha, 1, "k", *ARGS)
            await pipe.execute(raise_on_error=False)
        c1 = cpu()
        for _ in range(pipelines):
            for future in [minimal.call("EVALSHA", sha, 1, "k", *ARGS) for _ in range(size)]:
                await future
        c2 = cpu()
        for _ in range(pipelines):
            await channel.send([command] * size)
        c3 = cpu()
        per = pipelines * size
        print(f"pipelines of {size}: redis-py {(c1 - c0) / per * 1e6:.1f} us CPU a call; "
              f"minimal {(c2 - c1) / per * 1e6:.1f} us (one write per call); "
              f"channel {(c3 - c2) / per * 1e6:.1f} us (one write per pipeline)", flush=True)  # fmt: skip
    await channel.close()
    await client.aclose()


if __name__ == "__main__":
    uvloop.run(main())
