"""Exact load (gateway.state.round_ledger): what the replicas dispatched, not what the last
scrape saw. Its rules alone, and a real gateway over GPU-free engines placing a burst of
sessions that all arrive between two scrapes as the simulator places the same burst."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.state import round_ledger
from gateway.state.round_ledger import foreign
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from perfmodel.slo import derived_slo
from planner.simulator import Pool, SimConfig, Simulation
from planner.trace import TraceRound, TraceSession
from tests.test_kv_index import placing, synced

BURST, ENGINES, PROMPT_WORDS, OUTPUT_TOKENS = 9, 3, 200, 200
ARRIVAL_GAP_S = 0.04


@pytest.mark.unit
def test_a_request_is_foreign_only_where_the_ledger_never_had_it():
    scraped = {"a": 5, "b": 2, "c": 0}
    # a: 3 in flight before the scrape, 4 after (one started): one request is nobody's;
    # b: one round ended between the first read and the scrape; c: no scrape count at all.
    assert foreign(scraped, before={"a": 3, "b": 3}, after={"a": 4, "b": 2}) == {"a": 1, "b": 0, "c": 0}


@pytest.mark.unit
def test_a_round_placed_but_never_started_stops_counting(monkeypatch):
    ledger = round_ledger.RoundLedger(None, None, "p", None)  # type: ignore[arg-type]  # placing does no I/O
    ledger.placed(("w1", "t1"), ("w2", "t1:prefill"))
    ledger.placed(("w1", "t2"))
    assert ledger.unwritten() == Counter({"w1": 2, "w2": 1})
    later = time.monotonic() + round_ledger.UNWRITTEN_S + 0.1
    monkeypatch.setattr(round_ledger.time, "monotonic", lambda: later)
    assert ledger.unwritten() == Counter()


def simulated_spread() -> list[int]:
    """Requests per engine, most first, when the simulator places the burst by SGLang's rule."""
    profile = load_profile(DEFAULT_PROFILE)
    trace = [TraceSession(session_id=f"s{i}", arrival_s=0.001 * i,
                          rounds=[TraceRound(input_tokens=2 * PROMPT_WORDS, output_tokens=OUTPUT_TOKENS)])
             for i in range(BURST)]  # fmt: skip
    config = SimConfig(Pool(profile, ENGINES), None, derived_slo(profile), policy="coloc", placement="sglang-cache")
    sim = Simulation(config, trace)
    sim.run()
    return sorted(Counter(r.decode_worker for r in sim.records).values(), reverse=True)


def test_a_burst_between_two_scrapes_spreads_as_the_simulator_spreads_it(tmp_path: Path):
    """Nine new sessions 40 ms apart, all within one scrape interval (a second) and all in
    flight together, none of whose prompts any engine caches: SGLang's rule sends each to
    the engine with the fewest requests in flight. Read from the last scrape, every engine
    has none and all nine would go to one; counted as they are dispatched, they spread
    three a piece - what the simulator, which counts exactly, does too. (Sessions sent in
    the same millisecond can miss one another by one: a ledger read already on its way to
    Redis when another round's entry is written does not show it; gateway.state.round_ledger.)"""
    expected = simulated_spread()
    assert expected == [BURST // ENGINES] * ENGINES
    with placing(tmp_path, ENGINES, "sglang-cache", "--speed", "1") as (gateway, urls):
        model, rng = httpx.get(f"{next(iter(urls.values()))}/v1/models").json()["data"][0]["id"], random.Random(7)
        for engine_id, url in urls.items():  # the index places by an engine once it has seen it store a block
            synced(gateway.url, engine_id, url, model)
        bodies = [{"model": model, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "messages": [
            {"role": "user", "content": " ".join(f"w{rng.randint(0, 99_999)}" for _ in range(PROMPT_WORDS))}]}
            for _ in range(BURST)]  # fmt: skip
        together = threading.Barrier(BURST)

        def session(client: httpx.Client, index_and_body: tuple[int, dict]) -> str:
            index, body = index_and_body
            together.wait(timeout=30)
            time.sleep(ARRIVAL_GAP_S * index)  # nine within 0.4 s: between two scrapes, a second apart
            reply = client.post(f"{gateway.url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.headers["x-ampd-decode-worker"]

        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(BURST) as pool:
            placed = list(pool.map(lambda item: session(client, item), enumerate(bodies)))
        assert sorted(Counter(placed).values(), reverse=True) == expected, Counter(placed)
