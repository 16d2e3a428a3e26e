"""Schema fuzzing of the gateway's OpenAPI with schemathesis, over real HTTP.

A gateway and a GPU-free worker run in subprocesses; schemathesis generates requests
from the gateway's own document - valid ones and ones that break it - for every
operation. Whatever it sends: no 5xx, and every error in OpenAI's shape (Anthropic's
for Anthropic's Messages API, ``/v1/messages`` and its ``count_tokens``).

Hypothesis drives schemathesis's strategies directly: schemathesis's pytest
integration reads a pytest internal that pytest 9.2 removed.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from tests.engines import start_gateway, start_sim_worker, stop
from tests.test_gateway import REDIS_URL
from tests.test_gateway_resilience import cleanup

KEY = "sk-fuzz"
EXAMPLES = 100  # per operation and mode


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    prefix = f"fuzz-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "50")
    worker = start_sim_worker(tmp, "--role", "both", *registry)
    gateway = start_gateway(tmp, REDIS_URL, prefix, "--api-key", KEY)
    try:
        yield gateway.url
    finally:
        gateway.stop()
        stop(worker)
        cleanup(prefix)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_5xx_and_every_error_is_openai_shaped(gateway_url, mode):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json", timeout=10)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/responses", "/v1/messages",
                                              "/v1/sessions/{session_id}", "/v1/models"}  # fmt: skip
    if mode is GenerationMode.NEGATIVE:  # only what takes input can be given wrong input
        operations = [op for op in operations if op.method.upper() == "POST"]  # a path string is never invalid
    answered: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
            response = case.call(base_url=gateway_url, timeout=60)
            answered[(case.path, response.status_code)] += 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400 and case.path.startswith("/v1/messages"):  # Anthropic's, Anthropic's errors
                body = response.json()
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
                assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
            elif response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
                assert isinstance(error["message"], str) and error["message"], error

        check()
    print(mode, sorted(answered.items()))
    # Not vacuous: valid requests were served, and broken ones refused. A request
    # schemathesis broke may still be served, since the gateway passes what it does not
    # need to check through to the engine: only the 400s are required.
    for api in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        statuses = {status for (path, status) in answered if path == api}
        assert (200 if mode is GenerationMode.POSITIVE else 400) in statuses, (api, statuses)
