"""Where ampd leans on a library's private or undocumented interface, the seam is checked
here, so an upgrade that moves it fails with a message naming what moved, not as a wrong
reply deep in a load test. The library's range is pinned in pyproject.toml."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

pytestmark = pytest.mark.unit

SEAM = "gateway.state.redis_channel speaks to Redis with redis-py's own pieces"


def test_redis_py_error_parser_maps_error_replies_to_its_exceptions():
    try:
        from redis._parsers.base import BaseParser
    except ImportError as exc:  # pragma: no cover - only on an upgrade
        pytest.fail(f"{SEAM}: redis._parsers.base.BaseParser is gone in redis-py {redis.__version__} ({exc})")
    assert isinstance(BaseParser.parse_error("NOSCRIPT No matching script."), redis.exceptions.NoScriptError), SEAM
    assert isinstance(BaseParser.parse_error("WRONGPASS invalid username-password pair"),
                      redis.exceptions.AuthenticationError), SEAM  # fmt: skip
    assert type(BaseParser.parse_error("ERR unknown command")) is redis.exceptions.ResponseError, SEAM


@pytest.mark.parametrize(
    "url, kind",
    [("redis://u:p@127.0.0.1:6390/3?protocol=3&client_name=ampd", aioredis.Connection),
     ("rediss://127.0.0.1:6390/0", aioredis.SSLConnection),
     ("unix:///tmp/redis.sock?db=2", aioredis.UnixDomainSocketConnection)],
)  # fmt: skip
def test_a_pool_connection_carries_what_the_channel_opens_its_own_with(url, kind):
    """The channel builds a connection from the pool's class and kwargs and reads, without
    connecting, where to connect and what to send first (the handshake)."""
    client = aioredis.Redis.from_url(url, decode_responses=True)
    pool = client.connection_pool
    like = pool.connection_class(**pool.connection_kwargs)
    assert isinstance(like, kind), f"{SEAM}: redis-py {redis.__version__} builds {type(like)} for {url}"
    for name in ("protocol", "username", "password", "client_name", "db", "encoder"):
        assert hasattr(like, name), f"{SEAM}: a connection has no {name!r} in redis-py {redis.__version__}"
    for name in ("encoding", "encoding_errors", "decode_responses"):
        assert hasattr(like.encoder, name), f"{SEAM}: an encoder has no {name!r} in redis-py {redis.__version__}"
    if kind is aioredis.UnixDomainSocketConnection:
        assert like.path == "/tmp/redis.sock" and like.db == 2
    else:
        assert (like.host, like.port) == ("127.0.0.1", 6390)
    if kind is aioredis.SSLConnection:
        assert hasattr(like.ssl_context, "get"), f"{SEAM}: an SSL connection's context has no get()"
    if "protocol=3" in url:
        assert (like.protocol, like.username, like.password, like.client_name, like.db) == (3, "u", "p", "ampd", 3)
    # Replies are shaped by the client's own callbacks, as redis-py's parse_response applies them.
    assert callable(client.response_callbacks.get("EXPIRE")), f"{SEAM}: no response callback for EXPIRE"


def test_xdist_schedules_by_the_scope_our_scheduler_names():
    """tests/conftest.py's scheduler overrides pytest-xdist's private
    ``LoadScopeScheduling._split_scope``: each module one unit, the test_vllm* modules one."""
    from xdist.scheduler import LoadScopeScheduling

    from tests.conftest import by_module_scheduler

    assert callable(getattr(LoadScopeScheduling, "_split_scope", None)), "xdist no longer splits scopes there"
    scheduler = object.__new__(by_module_scheduler())
    assert scheduler._split_scope("tests/test_gateway.py::test_a[1]") == "tests/test_gateway.py"
    assert scheduler._split_scope("tests/test_vllm_handoffs.py::test_b") == "vllm"
    assert scheduler._split_scope("tests/test_vllm.py::test_c") == "vllm"
