"""vLLM's NIXL hand-off between TP degrees, on vLLM's CPU build.

Two `ampd worker vllm` engines serve the tiny Llama (two KV heads), one at TP 1 and one
at TP 2, both registered as `both` (NixlConnector ``kv_both``), and KV goes each way.
vLLM 0.32's connector maps KV heads between ranks: a TP 2 decoder's two ranks each read
their head from the TP 1 prefill rank; a TP 1 decoder reads one head from each of the
TP 2 prefill's ranks. Either way two transfers move each block's whole KV once.

What the KV holds is not checked: the random-weight model's greedy answer does not
depend on its prompt enough to tell right KV from wrong (the same 8 tokens came back
for two prompts that differ in two words), so these tests check the transfers'
accounting, as vLLM reports it.

Started for this module only, after tests/test_vllm.py's engines are gone (NIXL's UCX
threads busy-poll a core per rank).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_engine_protocol as protocol
from tests.engines import Engine
from tests.test_vllm import ROOT, VLLM_PYTHON, VLLM_TIMEOUT, first_handoff, running, start_vllm_worker

PULLS, BYTES = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum"
pytestmark = VLLM_TIMEOUT


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[tuple[Engine, Engine, int]]:
    """(TP 1 engine, TP 2 engine, KV bytes per token of the whole model)."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    tmp = tmp_path_factory.mktemp("vllm-mixed-tp")
    model_dir = tmp / "model"
    subprocess.run([VLLM_PYTHON, "-m", "workers.vllm.tiny_model", str(model_dir)], cwd=ROOT, check=True)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    kv_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2  # K and V
    prefix = f"vllm-tp-{uuid.uuid4().hex[:8]}"
    starts = (lambda: start_vllm_worker(tmp, model_dir, "tp1", prefix),
              lambda: start_vllm_worker(tmp, model_dir, "tp2", prefix, "--tp", "2"))  # fmt: skip
    with running(prefix, tmp, *starts) as (tp1, tp2):
        yield tp1, tp2, kv_bytes


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_kv_goes_between_tp_degrees_every_head_once(engines, prefill_tp):
    tp1, tp2, kv_bytes = engines
    prefill, decode = (tp1, tp2) if prefill_tp == 1 else (tp2, tp1)
    first_handoff(prefill, decode)  # this direction's NIXL handshake (see first_handoff)
    block = decode.block_size
    messages = [{"role": "user", "content": f"Case {uuid.uuid4().hex}. " + "Read the log line by line. " * 40}]
    before = decode.metrics()
    params, reply = protocol.handoff(prefill, decode, messages, 8, ignore_eos=True)
    after = decode.metrics_once(lambda m: m[PULLS] >= before[PULLS] + 2)

    blocks = len(params["remote_block_ids"][0])
    assert params["tp_size"] == prefill_tp and blocks >= 2
    assert after[PULLS] - before[PULLS] == 2  # one per rank pair
    assert after[BYTES] - before[BYTES] == blocks * block * kv_bytes  # every head of every block, once
    assert after["vllm:nixl_num_failed_transfers_total"] == before["vllm:nixl_num_failed_transfers_total"]

    assert reply["usage"]["prompt_tokens"] == params["remote_num_tokens"]
    assert reply["usage"]["completion_tokens"] == 8
