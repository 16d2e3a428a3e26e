"""Time one model's per-step GPU kernels with PyTorch, to check the roofline's constants.

perfmodel.roofline prices a step from published peaks discounted by fitted efficiencies
(the multi-vendor P/D paper, "Disaggregated Prefill and Decoding Inference System for
Large Language Model Serving on Multi-Vendor GPUs", Eq. 2 and 5), fitted to published
end-to-end numbers only. This module measures the work those pieces price, on the local
device, so the discounts can be checked against kernels rather than against a paper:

* prefill of ``n`` fresh tokens (no history): every layer over ``n`` tokens with causal
  attention, then the LM head on the last token (vLLM computes logits for it alone);
* one decode step of ``b`` sequences each with ``c`` tokens of KV cache: every layer
  over ``b`` tokens, each query attending to its own cache (the new token's K and V
  written into it), then the LM head on all ``b`` tokens.

A layer is a dense Llama-style decoder layer with random bf16 weights in the model's
real shapes: RMSNorm, fused QKV projection (grouped-query attention),
``torch.nn.functional.scaled_dot_product_attention``, O projection, RMSNorm, fused
gate/up projection, SwiGLU, down projection, residual adds. RoPE, the embedding lookup
and the prompt's KV-cache write are left out (elementwise, well under 1% of a step).
Decode attention packs a KV head's query heads as that head's query rows (one query
token, so no causal mask is needed and the cache is read once per KV head, as GQA
kernels do) instead of repeating K and V per query head. PyTorch's kernel does not split
a sequence's KV across thread blocks, so at batch 1-8 decode attention under-fills the
GPU where vLLM's split-KV FlashAttention would not (bench/results/kernels/).

On CUDA each measurement is captured once in a CUDA graph (torch.cuda.CUDAGraph) and
replayed: vLLM runs decode steps as CUDA graphs, so kernel-launch overhead must not
count; prefill is graphed too, so both numbers are GPU kernel time alone. Nothing of
the engine around the kernels is included - no scheduler, sampling, detokenisation or
other per-step overhead - which is why the comparison (:func:`compare`) leaves the
roofline's fixed ``step_overhead_s`` out. Times are CUDA-event medians of ``repeats``
replays after ``warmup`` ones; on the CPU (tests, tiny shapes) wall-clock medians.

Layers are timed as a stack and scaled by ``num_layers / layers_timed`` (the LM head is
timed apart and added unscaled). By default every layer is allocated; decode times
only as many as the free memory holds KV caches for, each layer with its own weights
and its own cache, so no timed layer reads what an earlier one left in L2.

Runs standalone with PyTorch alone (the GPU machine has no ampd dependencies):
``python3 planner/profiler/kernels.py --model-json MODEL.json --out RAW.json`` (a shipped
profile serves as MODEL.json; ``--tp N`` times one rank's shard); then
``ampd profile kernels --measured RAW.json`` compares it with the roofline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from perfmodel.specs import GPUSpec, ModelSpec

PREFILL_TOKENS = (16, 64, 256, 1024, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128)
DECODE_CONTEXTS = (1024, 4096)
KV_MEMORY_FRACTION = 0.5  # of the memory free after the weights, for decode's KV caches
RMS_EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    """The architecture numbers a dense decoder layer needs (a ModelSpec's fields)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Shape:
        if spec.get("num_experts", 1) != 1:
            raise ValueError("only dense models: this times a dense decoder layer, not MoE experts")
        return cls(**{name: int(spec[name]) for name in cls.__dataclass_fields__})

    def shard(self, tp: int) -> Shape:
        """What one of ``tp`` tensor-parallel ranks computes, as vLLM shards a Llama layer
        (Megatron-LM's column/row split): query heads, the MLP's intermediate width and the
        LM head's vocabulary divided by ``tp``; KV heads divided too, but replicated once
        ``tp`` exceeds them (each rank keeps at least one); the hidden size whole. The
        all-reduces between ranks are not in a shard's time (one GPU has no peer)."""
        if tp < 1 or self.num_attention_heads % tp or self.intermediate_size % tp:
            raise ValueError(f"TP {tp} does not divide {self.num_attention_heads} heads and "
                             f"{self.intermediate_size} intermediate width")  # fmt: skip
        return replace(
            self,
            num_attention_heads=self.num_attention_heads // tp,
            num_kv_heads=-(-self.num_kv_heads // tp),
            intermediate_size=self.intermediate_size // tp,
            vocab_size=-(-self.vocab_size // tp),
        )


def measure(
    shape: Shape,
    *,
    device: str = "cuda",
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    decode_batches: Sequence[int] = DECODE_BATCHES,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
    layers: int | None = None,
    tp: int = 1,
    warmup: int = 3,
    repeats: int = 10,
    progress: Callable[[str], None] = lambda line: None,
    checkpoint: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Time prefill and decode steps of ``shape`` (see the module docstring); JSON-able result.

    ``tp`` times one rank's shard of each layer (:meth:`Shape.shard`); the step's time
    is then that rank's kernel time, the all-reduces left out. ``layers`` caps how many
    layers are allocated (default all). A point that fails is
    recorded with its ``error`` and the rest still run; ``checkpoint`` gets the result so
    far after each point (a device run cut short keeps what it measured). On CUDA the
    result also holds a ``calibration``: what a large bf16 GEMM and a device copy reach.
    Raises RuntimeError when PyTorch is missing or ``device`` is unavailable.
    """
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("PyTorch is not installed in this Python (pip install torch)") from e
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to PyTorch (use --device cpu for a test run)")
    started = time.perf_counter()
    torch.manual_seed(0)
    model_shape, shape = shape, shape.shard(tp)
    allocated = min(layers or shape.num_layers, shape.num_layers)
    weights = [_layer_weights(torch, shape, dev) for _ in range(allocated)]
    final_norm = torch.ones(shape.hidden_size, dtype=torch.bfloat16, device=dev)
    lm_head = _random(torch, (shape.vocab_size, shape.hidden_size), dev)
    timer = _Timer(torch, dev, warmup, repeats)
    gqa = _prefill_gqa_mode(torch, shape, dev)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "shape": asdict(model_shape),
        "tp": tp,
        "shard": asdict(shape),
        "layers_allocated": allocated,
        "warmup": warmup,
        "repeats": repeats,
        "cuda_graphs": dev.type == "cuda",
        "prefill_gqa": gqa,
        "prefill": [],
        "decode": [],
    }

    def head(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            torch.nn.functional.rms_norm(x, (shape.hidden_size,), final_norm, RMS_EPS), lm_head
        )

    def record(kind: str, where: dict[str, int], run: Callable[[], tuple[int, float, float]]) -> None:
        try:
            point = _point(shape, where, *run())
            line = f"{point['seconds'] * 1e3:.3f} ms ({point['layers_timed']} layers timed)"
        except Exception as e:  # one failing point (say, out of memory) must not lose the others
            point = {**where, "error": f"{type(e).__name__}: {e}"[:400]}
            line = point["error"]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        result[kind].append(point)
        progress(f"{kind} {where}: {line}")
        checkpoint(result)

    def prefill(n: int) -> tuple[int, float, float]:
        x = torch.randn(n, shape.hidden_size, dtype=torch.bfloat16, device=dev)
        attends = [_prefill_attention(torch, shape, gqa)] * allocated
        return allocated, timer(lambda: _stack(torch, shape, x, weights, attends)), timer(lambda: head(x[-1:]))

    def decode(b: int, c: int) -> tuple[int, float, float]:
        per_layer = 2 * b * c * shape.num_kv_heads * shape.head_dim * 2
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
        timed = allocated if free is None else max(1, min(allocated, int(free * KV_MEMORY_FRACTION // per_layer)))
        caches = [_random(torch, (2, b, shape.num_kv_heads, c, shape.head_dim), dev, 1.0) for _ in range(timed)]
        x = torch.randn(b, shape.hidden_size, dtype=torch.bfloat16, device=dev)
        attends = [_decode_attention(torch, shape, cache) for cache in caches]
        return timed, timer(lambda: _stack(torch, shape, x, weights[:timed], attends)), timer(lambda: head(x))

    if dev.type == "cuda":
        try:
            result["calibration"] = _calibrate(torch, dev, timer)
        except Exception as e:  # context only: the points matter more
            result["calibration"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        progress(f"calibration: {result['calibration']}")
    for n in prefill_tokens:
        record("prefill", {"tokens": n}, lambda n=n: prefill(n))
    for c in decode_contexts:
        for b in decode_batches:
            record("decode", {"batch": b, "context": c}, lambda b=b, c=c: decode(b, c))
    result["timed_eagerly"] = timer.eager  # captures that failed (then launch overhead is included)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def _calibrate(torch: Any, dev: torch.device, timer: _Timer) -> dict[str, float]:
    """The device's attainable peaks, to read the efficiencies against: an 8192^3 bf16
    matrix product (TFLOP/s) and a 2 GiB device-to-device copy (TB/s, read + write)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    matmul_s = timer(lambda: a @ a)
    src = torch.empty(2**30, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    return {"matmul_tflops": 2 * 8192**3 / matmul_s / 1e12, "copy_tbps": 2 * src.nbytes / copy_s / 1e12}


def _point(shape: Shape, where: dict[str, int], timed: int, layers_s: float, head_s: float) -> dict[str, Any]:
    seconds = layers_s * shape.num_layers / timed + head_s
    return {**where, "layers_timed": timed, "layers_s": layers_s, "head_s": head_s, "seconds": seconds}


def _random(torch: Any, size: tuple[int, ...], dev: torch.device, std: float | None = None) -> torch.Tensor:
    """Random bf16 values; weights scaled by 1/sqrt(fan-in) so activations stay finite."""
    return torch.empty(size, dtype=torch.bfloat16, device=dev).normal_(0.0, std or size[-1] ** -0.5)


def _layer_weights(torch: Any, s: Shape, dev: torch.device) -> dict[str, torch.Tensor]:
    qkv = (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
    ones = torch.ones(s.hidden_size, dtype=torch.bfloat16, device=dev)
    return {
        "norm1": ones,
        "qkv": _random(torch, (qkv, s.hidden_size), dev),
        "o": _random(torch, (s.hidden_size, s.num_attention_heads * s.head_dim), dev),
        "norm2": ones.clone(),
        "gate_up": _random(torch, (2 * s.intermediate_size, s.hidden_size), dev),
        "down": _random(torch, (s.hidden_size, s.intermediate_size), dev),
    }


Attend = Callable[[Any, Any, Any], Any]  # (q, k, v) of shape (tokens, heads * head_dim) -> like q


def _stack(torch: Any, s: Shape, x: torch.Tensor, weights: list[dict[str, torch.Tensor]], attends: list[Attend]) -> Any:
    F = torch.nn.functional
    kv = s.num_kv_heads * s.head_dim
    for w, attend in zip(weights, attends, strict=True):
        q, k, v = F.linear(F.rms_norm(x, (s.hidden_size,), w["norm1"], RMS_EPS), w["qkv"]).split(
            [s.num_attention_heads * s.head_dim, kv, kv], dim=-1
        )
        x = x + F.linear(attend(q, k, v), w["o"])
        gate, up = F.linear(F.rms_norm(x, (s.hidden_size,), w["norm2"], RMS_EPS), w["gate_up"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, w["down"])
    return x


def _prefill_attention(torch: Any, s: Shape, gqa: str) -> Attend:
    """Causal attention of n fresh tokens; K and V repeated per query head only if the
    fused kernels refuse ``enable_gqa`` (see :func:`_prefill_gqa_mode`)."""
    group = s.num_attention_heads // s.num_kv_heads

    def attend(q: Any, k: Any, v: Any) -> Any:
        n = q.shape[0]
        q = q.view(n, s.num_attention_heads, s.head_dim).transpose(0, 1)[None]
        k = k.view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)[None]
        v = v.view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)[None]
        if gqa == "expanded":  # expand + reshape rather than repeat_interleave: no host sync in a graph
            k, v = (t[:, :, None].expand(1, s.num_kv_heads, group, n, s.head_dim).flatten(1, 2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "native")
        return out[0].transpose(0, 1).reshape(n, s.num_attention_heads * s.head_dim)

    return attend


def _decode_attention(torch: Any, s: Shape, cache: torch.Tensor) -> Attend:
    """One new token per sequence against its cache of c tokens (position c - 1 is the
    new token's), a KV head's ``group`` query heads packed as its query rows."""
    group = s.num_attention_heads // s.num_kv_heads
    k_cache, v_cache = cache[0], cache[1]  # (b, kv_heads, c, head_dim)

    def attend(q: Any, k: Any, v: Any) -> Any:
        b = q.shape[0]
        k_cache[:, :, -1].copy_(k.view(b, s.num_kv_heads, s.head_dim))
        v_cache[:, :, -1].copy_(v.view(b, s.num_kv_heads, s.head_dim))
        q = q.view(b, s.num_kv_heads, group, s.head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache)
        return out.reshape(b, s.num_attention_heads * s.head_dim)

    return attend


def _prefill_gqa_mode(torch: Any, s: Shape, dev: torch.device) -> str:
    """Prefill's GQA path: "native" if a fused attention kernel takes grouped K/V
    (``enable_gqa``), else "expanded" (K and V repeated per query head). On CUDA the math backend, which would
    materialise the n x n scores, is ruled out by :class:`_Timer`'s backend list."""
    if dev.type != "cuda":
        return "native"
    q = torch.randn(1, s.num_attention_heads, 64, s.head_dim, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(1, s.num_kv_heads, 64, s.head_dim, dtype=torch.bfloat16, device=dev)
    try:
        with _fused_attention_only(torch):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return "native"
    except RuntimeError:
        return "expanded"


def _fused_attention_only(torch: Any) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


class _Timer:
    """Median seconds of ``repeats`` runs of ``fn`` after ``warmup``: CUDA-graph replays
    timed by CUDA events on a GPU, wall clock on the CPU. A capture that fails falls back
    to timing ``fn`` eagerly, and says so in ``eager``."""

    def __init__(self, torch: Any, dev: torch.device, warmup: int, repeats: int) -> None:
        self.torch, self.dev, self.warmup, self.repeats = torch, dev, warmup, repeats
        self.eager: list[str] = []

    def __call__(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        with torch.inference_mode():
            if self.dev.type != "cuda":
                for _ in range(self.warmup):
                    fn()
                times = []
                for _ in range(self.repeats):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                return statistics.median(times)
            with _fused_attention_only(torch):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up before capture, on a side stream as CUDA graphs require
                    for _ in range(self.warmup):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        fn()
                    run = graph.replay
                except RuntimeError as e:
                    self.eager.append(f"{type(e).__name__}: {e}"[:300])
                    torch.cuda.synchronize()
                    run = fn
                for _ in range(self.warmup):
                    run()
                times = []
                for _ in range(self.repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
            del graph, run
            torch.cuda.empty_cache()
            return statistics.median(times)


@dataclass(frozen=True)
class Row:
    """One measurement next to the roofline's price of the same work, overhead excluded."""

    kind: str  # "prefill" or "decode"
    tokens: int  # prefill: n; decode: batch
    context: int  # decode: per-sequence context; prefill: 0
    measured_s: float
    predicted_s: float
    tflops: float  # the work's FLOPs (matmuls and attention, as the roofline counts them) per measured second
    tbps: float  # the work's HBM bytes (weights and KV read, as the roofline counts them) per measured second

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


def compare(raw: dict[str, Any], model: ModelSpec, gpu: GPUSpec) -> list[Row]:
    """Each measured point against ``roofline_profile(model, gpu, tp)`` (what `ampd profile
    roofline` derives) at the measurement's TP degree, without its fixed per-step overhead
    and, at TP > 1, without the all-reduces a shard's kernels do not include: prefill
    ``forward(n) + prefill_attention(n(n+1)/2)``, decode ``forward(b) + context_read(b c)``.
    FLOP/s and bytes/s are one rank's: the model's work divided by ``tp``."""
    from perfmodel.roofline import allreduce_seconds, roofline_profile

    tp = raw.get("tp", 1)
    profile = roofline_profile(model, gpu, tp)
    pieces, eff = profile.pieces, profile.efficiency

    def fixed(tokens: int) -> float:
        return eff.step_overhead_s + allreduce_seconds(model, gpu, tp, eff, tokens) if eff else 0.0

    rows = []
    for p in (p for p in raw["prefill"] if "seconds" in p):  # failed points carry an "error" instead
        n, pairs = p["tokens"], p["tokens"] * (p["tokens"] + 1) / 2
        predicted = pieces.forward(n) + pieces.prefill_attention(pairs) - fixed(n)
        flops = (model.matmul_flops_per_token * n + model.attention_flops_per_pair * pairs) / tp
        rows.append(Row("prefill", n, 0, p["seconds"], predicted, flops / p["seconds"] / 1e12,
                        model.weights_read_bytes(n) / tp / p["seconds"] / 1e12))  # fmt: skip
    for d in (d for d in raw["decode"] if "seconds" in d):
        b, c = d["batch"], d["context"]
        predicted = pieces.forward(b) + pieces.context_read(b * c) - fixed(b)
        flops = (model.matmul_flops_per_token * b + model.attention_flops_per_pair * b * c) / tp
        read = model.weights_read_bytes(b) / tp + model.kv_bytes_per_token_per_rank(tp) * b * c
        rows.append(Row("decode", b, c, d["seconds"], predicted, flops / d["seconds"] / 1e12,
                        read / d["seconds"] / 1e12))  # fmt: skip
    return rows


def check_shape(raw: dict[str, Any], model: ModelSpec) -> None:
    """Refuse to compare measurements of another architecture than ``model``'s."""
    if raw["shape"] != asdict(Shape.from_dict(model.model_dump())):
        raise ValueError(f"the measurements are of shape {raw['shape']}, not {model.name}'s")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time a dense model's prefill and decode kernels (PyTorch only).")
    parser.add_argument(
        "--model-json",
        required=True,
        help="a ModelSpec's JSON (or its shape fields, or a profile holding it): a file or the text",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefill", type=_ints, default=list(PREFILL_TOKENS), help="tokens, comma-separated")
    parser.add_argument("--batches", type=_ints, default=list(DECODE_BATCHES))
    parser.add_argument("--contexts", type=_ints, default=list(DECODE_CONTEXTS))
    parser.add_argument("--layers", type=int, default=None, help="allocate at most this many layers")
    parser.add_argument("--tp", type=int, default=1, help="time one rank's shard at this tensor-parallel degree")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    text = args.model_json if args.model_json.lstrip().startswith("{") else Path(args.model_json).read_text()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(result: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    try:
        spec = json.loads(text)
        write(measure(Shape.from_dict(spec.get("model", spec)), device=args.device, prefill_tokens=args.prefill,
                      decode_batches=args.batches, decode_contexts=args.contexts, layers=args.layers,
                      tp=args.tp, warmup=args.warmup, repeats=args.repeats, checkpoint=write,
                      progress=lambda line: print(line, file=sys.stderr, flush=True)))  # fmt: skip
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
