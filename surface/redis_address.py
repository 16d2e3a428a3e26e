"""Where a deployment's Redis is, as every ampd process is told it: one URL, two forms.

* ``redis://[[user]:password@]host:port/db`` (and redis-py's ``rediss://`` and ``unix://``):
  one Redis server.
* ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``: the
  primary that Redis Sentinel manages under ``service``, found by asking the sentinels
  listed (port 26379 where none is given). The credentials are the primary's; the
  sentinels are asked without any.

The gateway, the engines' registrations and the tools workers all build their clients
here, so that a sentinel-managed Redis is reached the same way everywhere: through
redis-py's own Sentinel support, whose connections ask the sentinels for the primary each
time they (re)connect and so follow a failover. A URL this module cannot read is a
``ValueError`` naming what is wrong, raised before any process starts serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.connection import parse_url
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel://"
SENTINEL_PORT = 26379
# A sentinel that does not answer within this is passed over for the next one listed: a
# hung sentinel must not hold up finding the primary through the others.
SENTINEL_TIMEOUT_S = 1.0
_SENTINEL_OPTIONS = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
SENTINEL_FORM = "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]"


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """redis-py's sentinel-managed pool that waits for a free connection instead of failing,
    as the gateway's pool for a plain URL does when hundreds of requests are in flight."""


@dataclass(frozen=True)
class RedisAddress:
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()  # empty: a plain URL, ``url`` itself
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> RedisAddress:
        """The address ``url`` names; a ``ValueError`` saying what is wrong if it names none."""
        if not url.startswith(SENTINEL_SCHEME):
            parse_url(url)  # redis-py's own reading, for its error now rather than at the first command
            return cls(url)
        rest = url[len(SENTINEL_SCHEME) :]
        if "?" in rest or "#" in rest:
            raise ValueError(f"{url!r}: a sentinel URL takes no query or fragment ({SENTINEL_FORM})")
        credentials, _, rest = rest.rpartition("@")
        hosts, _, path = rest.partition("/")
        service, _, db = path.partition("/")
        if not hosts or not service or "/" in db:
            raise ValueError(f"{url!r} is not {SENTINEL_FORM}")
        username, password = _credentials(credentials)
        return cls(url, tuple(_sentinel(url, h) for h in hosts.split(",")), unquote(service), _db(url, db),
                   username, password)  # fmt: skip

    @property
    def managed(self) -> bool:
        """Whether Sentinel manages this Redis (and so it has replicas and can fail over)."""
        return bool(self.sentinels)

    def client(self, **options: Any) -> redis.Redis:
        """A synchronous client (rq's); ``options`` as redis-py's client takes them."""
        if not self.managed:
            return redis.Redis.from_url(self.url, **options)
        sentinel = Sentinel(list(self.sentinels), sentinel_kwargs=_SENTINEL_OPTIONS)
        return sentinel.master_for(self.service, **self._primary_options(options))

    def async_client(self, *, blocking: bool = False, **options: Any) -> aioredis.Redis:
        """An asyncio client; ``blocking``: its pool waits for a free connection (redis-py's
        ``BlockingConnectionPool``, with ``max_connections`` and ``timeout`` in ``options``)."""
        if not self.managed:
            if blocking:
                return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(self.url, **options))
            return aioredis.from_url(self.url, **options)
        sentinel = AsyncSentinel(list(self.sentinels), sentinel_kwargs=_SENTINEL_OPTIONS)
        pool = _BlockingSentinelPool if blocking else AsyncSentinelPool
        return sentinel.master_for(self.service, connection_pool_class=pool, **self._primary_options(options))

    def _primary_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, **options}


async def follow_primary(client: aioredis.Redis) -> tuple[str, int] | None:
    """Have a client of a Sentinel-managed Redis ask the sentinels where the primary is now
    (its host and port), so that redis-py closes its idle connections to one they no longer
    name. redis-py asks only when it opens a connection, and after a switch-over the old
    primary keeps its clients - and takes writes its resync will discard - until the
    sentinels get round to demoting it, seconds later. None, and nothing asked, for a plain Redis."""
    pool = client.connection_pool
    if not isinstance(pool, AsyncSentinelPool):
        return None
    host, port = await pool.get_master_address()
    return host, int(port)


def _credentials(text: str) -> tuple[str | None, str | None]:
    if not text:
        return None, None
    user, colon, password = text.partition(":")
    return unquote(user) or None, unquote(password) if colon else None


def _sentinel(url: str, text: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6 address][:port]``) of one sentinel."""
    if text.startswith("["):
        host, _, after = text[1:].partition("]")
        port = after.removeprefix(":") if after.startswith(":") else after
    else:
        host, _, port = text.partition(":")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"{url!r}: {text!r} is not a sentinel's host[:port] ({SENTINEL_FORM})")
    return host, int(port) if port else SENTINEL_PORT


def _db(url: str, text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{url!r}: the database {text!r} is not a number ({SENTINEL_FORM})")
    return int(text)
