"""Why one stream's phases take 10-25x what the same code takes in a loop.

A one-off harness, not part of the package. It times the first thing a round does with
a one-message request - the body checked by pydantic, its tool messages, its messages
dumped and its conversation hashed - 300 times each way: hot (back to back); after 64 MiB
of other memory was written (the caches hold someone else's data, as after the engine and
the load generator ran); after a 12 ms pause (the core idled, as it does between one
stream's requests while the engine works); and after both, which is the one-stream case.
The gateway's own timing of the same call at one stream (`phase_breakdown.py` with it
wrapped) was 0.119 ms.

    taskset -c 1 .venv/bin/python bench/studies/overhead_hot_path/cold_read.py

Output of the run behind the overhead study: bench/results/overhead/hot_path/cold_read.txt.
"""

import statistics
import time

import numpy as np

from gateway.apis.schema import ChatRequest, check_tool_messages
from gateway.state.sessions import conversation_hashes

WAYS = (("hot", False, 0.0), ("caches evicted", True, 0.0), ("after 12 ms idle", False, 0.012), ("both", True, 0.012))
BODY = {"model": "m", "messages": [{"role": "user", "content": "bench abc 1 2"}], "max_tokens": 32, "stream": True}


def read_round() -> None:
    request = ChatRequest.model_validate(BODY)
    check_tool_messages(request.messages)
    conversation_hashes("scope", request.model_dump(include={"messages"}, exclude_none=True)["messages"])


def main() -> None:
    other = np.ones(64 * 2**20 // 8)
    for label, evict, pause_s in WAYS:
        times = []
        for _ in range(300):
            if evict:
                other += 1.0
            if pause_s:
                time.sleep(pause_s)
            started = time.perf_counter()
            read_round()
            times.append(time.perf_counter() - started)
        print(f"{label:>16}: median {statistics.median(times) * 1e6:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
