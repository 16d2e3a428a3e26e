"""Derive a profile from first principles when no measurements exist.

Each piece of the performance model (perfmodel.profile) is computed as a roofline: a
step takes the longer of its math at the discounted peak FLOP/s and its memory
traffic at the discounted HBM bandwidth, plus tensor-parallel communication and a
fixed per-step overhead - the discounted compute/memory/communication sums of the
multi-vendor P/D paper ("Disaggregated Prefill and Decoding Inference System for Large
Language Model Serving on Multi-Vendor GPUs", Eq. 2 and 5). The exact roofline is then
sampled and fitted with the same piecewise alpha-beta fitter the profiler uses, so a
derived profile and a measured one have the same form (AMPD section 3).
"""

from __future__ import annotations

import numpy as np

from perfmodel.catalog import GPUS, MODELS, PAPER_SETUPS, TP_DEGREES
from perfmodel.memory import MemoryPlan, fits, kv_capacity_tokens
from perfmodel.piecewise import Piece, PiecewiseLinear, fit_piecewise
from perfmodel.profile import CostPieces, Efficiency, Profile
from perfmodel.specs import DTYPE_BYTES, GPUSpec, ModelSpec

HOPPER_EFFICIENCY = Efficiency(
    compute=0.45,
    attention=0.4,
    memory=0.85,
    interconnect=0.7,
    network=0.8,
    allreduce_latency_s=10e-6,
    step_overhead_s=4e-3,
    kv_transfer_latency_s=5e-3,
    source=(
        "compute 0.45, memory 0.85 and 4 ms per step (scheduler, sampling, kernel launch) "
        "chosen by grid search to minimise the mean relative error against the 20 "
        "measurements of DOPD Table I ("
        "Llama-3.3-70B-FP8 on one H100): mean 7.5%, worst 23% (short prefills, where "
        "the roofline's sharp memory/compute corner is optimistic); `ampd profile check` "
        "prints the table. attention 0.4: FlashAttention-2/3 forward reaches 35-50% of "
        "peak; all-reduce 10 us and 70% of NVLink from nccl-tests on 8-GPU NVLink nodes; "
        "KV transfer 5 ms fixed per transfer at 80% of the NIC (DOPD section II reports "
        "15-80 ms per NIXL transfer including fragmentation)"
    ),
)

# The same figures fitted jointly to DOPD's Table I and the project's kernel timings
# (perfmodel.calibration; `ampd profile calibrate`), engine overhead apart from kernel time.
CALIBRATED_EFFICIENCY = HOPPER_EFFICIENCY.model_copy(
    update={
        "compute": 0.603,
        "compute_fp8": 0.438,
        "attention": 0.75,
        "memory": 0.90,
        "step_overhead_s": 6.92e-3,
        "source": (
            "compute (BF16 GEMMs) and attention fitted to kernel prefills of 256-8192 tokens timed on "
            "H100 and H200 (Llama-3.1-8B, Llama-3.1-70B at TP 2/4/8 shard shapes; kernel time only), "
            "FP8 GEMMs, HBM bandwidth and the fixed step overhead to DOPD Table I (Llama-3.3-70B-FP8 "
            "on one H100, whole engine steps), jointly: `ampd profile calibrate`; attention is at its "
            "bound (0.75, FlashAttention-3's best) and memory at its (0.9 of the datasheet). The other "
            "figures are HOPPER_EFFICIENCY's"
        ),
    }
)

DEFAULT_MEMORY = MemoryPlan()

# Sample grids and knots: geometric, covering what one engine step or transfer can see.
_TOKEN_GRID = np.unique(np.geomspace(1, 65536, 120).round())
_TOKEN_KNOTS = [2.0**k for k in range(1, 16)]


def _forward_seconds(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency, tokens: float) -> float:
    return (
        eff.step_overhead_s
        + forward_kernel_seconds(model, gpu, tp, eff, tokens)
        + allreduce_seconds(model, gpu, tp, eff, tokens)
    )


def forward_kernel_seconds(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency, tokens: float) -> float:
    """One rank's GEMMs over ``tokens`` tokens: the longer of their math and their weight
    reads, without the step's fixed overhead or the all-reduces between ranks."""
    peak = gpu.peak_flops[model.weight_dtype] * eff.compute_for(model.weight_dtype) * tp
    math_s = model.matmul_flops_per_token * tokens / peak
    memory_s = model.weights_read_bytes(int(tokens)) / (gpu.hbm_bandwidth * eff.memory * tp)
    return max(math_s, memory_s)


def prefill_attention_seconds_per_pair(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency) -> float:
    """Causal attention's cost per (query, key) pair of a prefill, on one rank's heads."""
    return model.attention_flops_per_pair / (gpu.peak_flops[model.weight_dtype] * eff.attention * tp)


def context_read_seconds_per_token(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency) -> float:
    """Decode attention's cost per token of context: one rank reads its share of the KV."""
    return model.kv_bytes_per_token_per_rank(tp) / (gpu.hbm_bandwidth * eff.memory)


def allreduce_seconds(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency, tokens: float) -> float:
    """Tensor parallelism's communication in one forward pass: two all-reduces per layer
    (after attention and after the MLP), ring algorithm over the node's interconnect."""
    if tp == 1:
        return 0.0
    message = tokens * model.hidden_size * DTYPE_BYTES["bf16"]
    ring = 2 * (tp - 1) / tp * message / (gpu.intra_node_bandwidth * eff.interconnect)
    return 2 * model.num_layers * (eff.allreduce_latency_s + ring)


def _ridge(model: ModelSpec, gpu: GPUSpec, eff: Efficiency) -> float:
    """Tokens per step where the forward pass turns from memory- to compute-bound.

    A knot there lets the fit follow the roofline's kink exactly (dense models).
    """
    flops = gpu.peak_flops[model.weight_dtype] * eff.compute_for(model.weight_dtype)
    bandwidth = gpu.hbm_bandwidth * eff.memory
    for tokens in np.geomspace(1, 65536, 2000):
        if model.matmul_flops_per_token * tokens / flops >= model.weights_read_bytes(int(tokens)) / bandwidth:
            return float(tokens)
    return 65536.0


def _linear(unit: str, seconds_per_unit: float, alpha: float = 0.0) -> PiecewiseLinear:
    """Costs that are exactly linear need no fit: one piece, zero error."""
    piece = Piece(upto=None, alpha=alpha, beta=seconds_per_unit)
    return PiecewiseLinear(unit=unit, pieces=[piece], max_rel_error=0.0)


def roofline_profile(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    efficiency: Efficiency = HOPPER_EFFICIENCY,
    memory: MemoryPlan = DEFAULT_MEMORY,
) -> Profile:
    seconds = [_forward_seconds(model, gpu, tp, efficiency, t) for t in _TOKEN_GRID]
    forward = fit_piecewise(_TOKEN_GRID, seconds, knots=_TOKEN_KNOTS + [_ridge(model, gpu, efficiency)], unit="tokens")
    pieces = CostPieces(
        forward=forward,
        prefill_attention=_linear("query-key pairs", prefill_attention_seconds_per_pair(model, gpu, tp, efficiency)),
        context_read=_linear("tokens", context_read_seconds_per_token(model, gpu, tp, efficiency)),
        kv_transfer=_linear(
            "bytes",
            1.0 / (gpu.network_bandwidth * efficiency.network),
            alpha=efficiency.kv_transfer_latency_s,
        ),
        kv_transfer_node=_linear(
            "bytes",
            1.0 / (gpu.intra_node_bandwidth * efficiency.interconnect),
            alpha=efficiency.kv_transfer_latency_s,
        ),
    )
    return Profile(
        name=profile_name(model, gpu, tp),
        method="roofline",
        model=model,
        gpu=gpu,
        tp=tp,
        memory=memory,
        kv_capacity_tokens=kv_capacity_tokens(model, gpu, tp, memory),
        efficiency=efficiency,
        pieces=pieces,
        notes=(
            "Derived by perfmodel.roofline from the model and GPU specs above; regenerate "
            "with `ampd profile roofline`. Replace with `ampd profile --worker URL` "
            "measurements where hardware is available."
        ),
    )


def profile_name(model: ModelSpec, gpu: GPUSpec, tp: int) -> str:
    return f"{model.name}_{gpu.name.lower()}_tp{tp}"


def paper_profiles() -> list[Profile]:
    """The shipped profiles: every paper setup at every TP degree where it fits."""
    out = []
    for model_name, gpu_name in PAPER_SETUPS:
        model, gpu = MODELS[model_name], GPUS[gpu_name]
        out += [roofline_profile(model, gpu, tp) for tp in TP_DEGREES if fits(model, gpu, tp, DEFAULT_MEMORY)]
    return out


def roofline_kv_transfer(gpu: GPUSpec, node: bool = False) -> PiecewiseLinear:
    """The roofline's T_kv piece (HOPPER_EFFICIENCY) between servers, or within one (``node``):
    for the path a profile did not measure."""
    eff = HOPPER_EFFICIENCY
    bandwidth = gpu.intra_node_bandwidth * eff.interconnect if node else gpu.network_bandwidth * eff.network
    return PiecewiseLinear(
        unit="bytes", pieces=[Piece(upto=None, alpha=eff.kv_transfer_latency_s, beta=1.0 / bandwidth)]
    )
