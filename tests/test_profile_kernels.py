"""planner/profiler/kernels.py on the CPU: a tiny dense model's prefill and decode steps
timed with PyTorch (the CPU torch of vLLM's venv; ampd's own venv has no torch), then
priced by the roofline. CI has no GPU: the timings' worth is checked on one by hand
(bench/results/kernels/); here, that every point is timed and the comparison is sane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampd.cli import app
from perfmodel.catalog import GPUS
from perfmodel.specs import ModelSpec
from planner.profiler.kernels import compare
from tests.test_vllm import ROOT, VLLM_PYTHON

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
PREFILL, BATCHES, CONTEXTS = [8, 64, 512], [1, 4], [32, 256]


def test_a_tiny_model_is_timed_on_the_cpu_and_priced_by_the_roofline(tmp_path):
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    out = tmp_path / "raw.json"
    # Run as a file, not a module: sys.path then lacks the repository, as on a GPU machine
    # without ampd's dependencies, so the script must need PyTorch alone. One thread: on a
    # busy two-core runner a pool of spinning threads stalled single steps by ~85 ms.
    subprocess.run([VLLM_PYTHON, "planner/profiler/kernels.py", "--model-json", str(tmp_path / "tiny.json"),
                    "--device", "cpu", "--out", str(out), "--prefill", ",".join(map(str, PREFILL)),
                    "--batches", ",".join(map(str, BATCHES)), "--contexts", ",".join(map(str, CONTEXTS)),
                    "--warmup", "1", "--repeats", "5"], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    raw = json.loads(out.read_text())
    assert raw["shape"] == TINY and raw["device"] == "cpu" and not raw["cuda_graphs"]
    assert [p["tokens"] for p in raw["prefill"]] == PREFILL
    assert [(d["batch"], d["context"]) for d in raw["decode"]] == [(b, c) for c in CONTEXTS for b in BATCHES]
    for point in raw["prefill"] + raw["decode"]:
        assert "error" not in point, point
        assert point["layers_timed"] == TINY["num_layers"]
        assert 0 < point["head_s"] < point["seconds"] and point["layers_s"] > 0
    # No ordering of the times is asserted: on a shared CPU a preempted step can invert two
    # microsecond-scale points; the GPU runs in bench/results/kernels/ are the timing check.

    model = ModelSpec(name="tiny", hf_id="none", max_model_len=1024, source="this test", **TINY)
    rows = compare(raw, model, GPUS["H100"])
    assert len(rows) == len(PREFILL) + len(BATCHES) * len(CONTEXTS)
    assert all(r.measured_s > 0 and r.predicted_s > 0 and r.ratio > 0 for r in rows)
    assert rows[-1].predicted_s > rows[-2].predicted_s  # a bigger batch at the same context costs more

    # The measurements are not Llama-3.1-8B's: `ampd profile kernels --measured` refuses them.
    result = CliRunner().invoke(app, ["profile", "kernels", "--model", "llama-3.1-8b", "--measured", str(out)])
    assert result.exit_code == 1 and "not llama-3.1-8b's" in result.output


@pytest.mark.unit
def test_without_torch_the_command_fails_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    result = CliRunner().invoke(app, ["profile", "kernels", "--model", "llama-3.1-8b", "--gpu", "H100"])
    assert result.exit_code == 1
    assert result.output.strip() == "PyTorch is not installed in this Python (pip install torch)"


@pytest.mark.unit
def test_a_tp_shard_divides_heads_width_and_vocabulary_and_is_priced_without_its_all_reduces():
    from perfmodel.catalog import MODELS
    from perfmodel.roofline import HOPPER_EFFICIENCY, allreduce_seconds, roofline_profile
    from planner.profiler.kernels import Shape

    llama = MODELS["llama-3.1-70b"]
    shape = Shape.from_dict(llama.model_dump())
    shard = shape.shard(8)
    assert (shard.num_attention_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (
        8, 1, 3584, 16032)  # fmt: skip
    assert (shard.hidden_size, shard.num_layers, shard.head_dim) == (8192, 80, 128)
    assert shape.shard(16).num_kv_heads == 1  # KV heads replicated past their count
    with pytest.raises(ValueError, match="does not divide"):
        shape.shard(3)

    # One point timed at TP 4 is priced by the TP 4 roofline less its overhead and all-reduces.
    raw = {"tp": 4, "prefill": [{"tokens": 1024, "seconds": 0.05}], "decode": [{"batch": 8, "context": 4096,
           "seconds": 0.01}]}  # fmt: skip
    gpu = GPUS["H200"]
    pieces = roofline_profile(llama, gpu, 4).pieces
    prefill, decode = compare(raw, llama, gpu)
    fixed = HOPPER_EFFICIENCY.step_overhead_s
    assert prefill.predicted_s == pytest.approx(
        pieces.forward(1024) + pieces.prefill_attention(1024 * 1025 / 2) - fixed
        - allreduce_seconds(llama, gpu, 4, HOPPER_EFFICIENCY, 1024))  # fmt: skip
    assert decode.predicted_s == pytest.approx(
        pieces.forward(8) + pieces.context_read(8 * 4096) - fixed
        - allreduce_seconds(llama, gpu, 4, HOPPER_EFFICIENCY, 8))  # fmt: skip
    assert allreduce_seconds(llama, gpu, 4, HOPPER_EFFICIENCY, 1024) > 0 == allreduce_seconds(
        llama, gpu, 1, HOPPER_EFFICIENCY, 1024)  # fmt: skip
