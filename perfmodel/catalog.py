"""Published model architectures and GPU capabilities the shipped profiles derive from.

Each entry says where its numbers come from. Parameter counts are computed from the
architecture (perfmodel.specs.ModelSpec.params_total) and agree with the model cards:
8.03B (Llama-3.1-8B), 70.55B (Llama-3.1-70B), 32.76B (Qwen3-32B), 46.70B (Mixtral-8x7B).
"""

from __future__ import annotations

from perfmodel.specs import GPUSpec, ModelSpec

GiB = 2**30
TB = 1e12
GB = 1e9

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            name="llama-3.1-8b",
            hf_id="meta-llama/Llama-3.1-8B-Instruct",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            max_model_len=32768,
            source="config.json of meta-llama/Llama-3.1-8B-Instruct; served at 32k context",
        ),
        ModelSpec(
            name="llama-3.1-70b",
            hf_id="meta-llama/Llama-3.1-70B-Instruct",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            max_model_len=32768,
            source="config.json of meta-llama/Llama-3.1-70B-Instruct; served at 32k context",
        ),
        ModelSpec(
            name="llama-3.3-70b-fp8",
            hf_id="nvidia/Llama-3.3-70B-Instruct-FP8",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            max_model_len=8192,
            weight_dtype="fp8",
            kv_dtype="fp8",
            source=(
                "Llama-3.3-70B has Llama-3.1-70B's architecture; FP8 weights and KV as in "
                "DOPD (Table I), used only to check "
                "the roofline against that table"
            ),
        ),
        ModelSpec(
            name="qwen3-32b",
            hf_id="Qwen/Qwen3-32B",
            num_layers=64,
            hidden_size=5120,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=25600,
            vocab_size=151936,
            max_model_len=32768,
            source="config.json of Qwen/Qwen3-32B (native context 32k)",
        ),
        ModelSpec(
            name="mixtral-8x7b",
            hf_id="mistralai/Mixtral-8x7B-Instruct-v0.1",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=32000,
            num_experts=8,
            experts_per_token=2,
            max_model_len=32768,
            source="config.json of mistralai/Mixtral-8x7B-Instruct-v0.1 (8 experts, top-2)",
        ),
    ]
}

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec(
            name="H100",
            memory_bytes=80 * GiB,
            hbm_bandwidth=3.35 * TB,
            peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
            intra_node_bandwidth=450 * GB,
            network_bandwidth=50 * GB,
            source=(
                "NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS BF16 and "
                "1979 TFLOPS FP8 dense, NVLink 4 900 GB/s bidirectional (450 GB/s each way); "
                "one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s)"
            ),
        ),
        GPUSpec(
            name="H200",
            memory_bytes=141 * GiB,
            hbm_bandwidth=4.8 * TB,
            peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
            intra_node_bandwidth=450 * GB,
            network_bandwidth=50 * GB,
            source=(
                "NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS BF16 and "
                "1979 TFLOPS FP8 dense (the H100's compute), NVLink 900 GB/s bidirectional "
                "(450 GB/s each way); one 400 Gb/s NIC per GPU (50 GB/s). nvidia-smi shows "
                "143,771 MiB. Its profiles are derived on demand, not shipped"
            ),
        ),
        GPUSpec(
            name="H20",
            memory_bytes=96 * GiB,
            hbm_bandwidth=4.0 * TB,
            peak_flops={"bf16": 148e12, "fp16": 148e12, "fp8": 296e12},
            intra_node_bandwidth=450 * GB,
            network_bandwidth=25 * GB,
            source=(
                "NVIDIA H20 product brief: 96 GB HBM3 at 4.0 TB/s, 148 TFLOPS BF16 and "
                "296 TFLOPS FP8 dense, NVLink 900 GB/s bidirectional; network per GPU from "
                "AMPD section 7.1 (200 GB/s InfiniBand per 8-GPU server)"
            ),
        ),
        GPUSpec(
            name="L40",
            memory_bytes=48 * GiB,
            hbm_bandwidth=864 * GB,
            peak_flops={"bf16": 181e12, "fp16": 181e12, "fp8": 362e12},
            intra_node_bandwidth=32 * GB,
            network_bandwidth=25 * GB,
            source=(
                "NVIDIA L40 datasheet: 48 GB GDDR6 at 864 GB/s, 181 TFLOPS BF16 and 362 TFLOPS "
                "FP8 dense; no NVLink, so tensor parallelism goes over PCIe Gen4 x16 (32 GB/s "
                "each way); one 200 Gb/s NIC per GPU assumed. A heterogeneous-pool example "
                "(the multi-vendor P/D paper); its profiles are derived on demand, not shipped"
            ),
        ),
    ]
}

# The setups the shipped profiles cover: AMPD section 7.1's three models on H20, and
# Llama-3.1-8B on H100 (the GPU-free engine's default), at every TP degree that fits.
PAPER_SETUPS: list[tuple[str, str]] = [
    ("llama-3.1-70b", "H20"),
    ("qwen3-32b", "H20"),
    ("mixtral-8x7b", "H20"),
    ("llama-3.1-8b", "H100"),
]
TP_DEGREES = (1, 2, 4, 8)
