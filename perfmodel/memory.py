"""Memory model: whether a model fits at a TP degree, and how many KV tokens remain.

Per GPU, vLLM gives ``gpu_memory_utilization`` of the memory to the engine; the
weights take their shard, the activation peak and runtime buffers take a reserve,
and the rest becomes the paged KV cache (the multi-vendor P/D paper, Eq. 6: weight + activation + KV).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from perfmodel.specs import GPUSpec, ModelSpec


class MemoryPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    activation_reserve_bytes: int = Field(
        default=4 * 2**30,
        description=(
            "per GPU: vLLM's profiled activation peak at max_num_batched_tokens=8192, CUDA "
            "graphs and NCCL buffers; 2-5 GiB is typical for 8B-70B models"
        ),
    )


def kv_capacity_tokens(model: ModelSpec, gpu: GPUSpec, tp: int, plan: MemoryPlan) -> int:
    """Tokens of KV cache one replica of ``tp`` GPUs can hold (0 if the weights do not fit)."""
    free = gpu.memory_bytes * plan.gpu_memory_utilization - model.weights_bytes / tp
    free -= plan.activation_reserve_bytes
    if free <= 0:
        return 0
    return int(free // model.kv_bytes_per_token_per_rank(tp))


def fits(model: ModelSpec, gpu: GPUSpec, tp: int, plan: MemoryPlan) -> bool:
    """A replica is feasible when its KV cache holds at least one full-length sequence.

    That is the check vLLM itself makes at start-up (it refuses a max_model_len the
    KV cache cannot hold).
    """
    return kv_capacity_tokens(model, gpu, tp, plan) >= model.max_model_len
