"""What a model and a GPU are, as far as serving cost is concerned.

These are the inputs of the performance model: the model's architecture (AMPD
appendix A.1, "model specifications") and the GPU's published capabilities
("hardware characteristics"). Derived quantities - bytes of KV per token, bytes of
weights, FLOPs per token - are computed here once and written into every profile so
a profile file can be read without this code.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

Dtype = Literal["bf16", "fp16", "fp8", "fp32"]  # fp32: vLLM's CPU build, where bf16 kernels are slow
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


class _Spec(BaseModel):
    """Accepts its computed fields on input (profiles carry them) but checks them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="wrap")
    @classmethod
    def _check_derived(cls, data, handler):
        if not isinstance(data, dict):
            return handler(data)
        given = {k: data[k] for k in cls.model_computed_fields if k in data}
        spec = handler({k: v for k, v in data.items() if k not in given})
        for name, value in given.items():
            if getattr(spec, name) != value:
                raise ValueError(f"{name}={value} disagrees with the architecture ({getattr(spec, name)})")
        return spec


class ModelSpec(_Spec):
    name: str
    hf_id: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="per expert for MoE models")
    vocab_size: int = Field(gt=0)
    num_experts: int = Field(default=1, ge=1)
    experts_per_token: int = Field(default=1, ge=1)
    tie_word_embeddings: bool = False
    max_model_len: int = Field(gt=0, description="context served (vLLM --max-model-len)")
    weight_dtype: Dtype = "bf16"
    kv_dtype: Dtype = "bf16"
    source: str

    @computed_field
    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, whole model (all TP ranks together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @computed_field
    @property
    def params_total(self) -> int:
        """Parameters counted from the architecture (norm weights included, biases none)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2
        if self.num_experts == 1:
            mlp = 3 * h * self.intermediate_size
        else:
            mlp = self.num_experts * (3 * h * self.intermediate_size + h)  # experts + router
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @computed_field
    @property
    def weights_bytes(self) -> int:
        return self.params_total * DTYPE_BYTES[self.weight_dtype]

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts (SwiGLU: three matrices each); 0 if dense."""
        if self.num_experts == 1:
            return 0
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.intermediate_size

    @property
    def params_active(self) -> int:
        per_expert = self.expert_params // self.num_experts if self.num_experts > 1 else 0
        return self.params_total - self.expert_params + per_expert * self.experts_per_token

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs per active parameter, excluding the embedding lookup (not a matmul).

        The LM head is charged on every token; vLLM computes logits only for the last
        prompt token, so prefill is overestimated by V*H/P (about 1% for 70B models).
        """
        return 2.0 * (self.params_active - self.vocab_size * self.hidden_size)

    @property
    def attention_flops_per_pair(self) -> float:
        """QK^T and PV for one (query, key) pair across all layers and heads."""
        return 4.0 * self.num_layers * self.num_attention_heads * self.head_dim

    def weights_read_bytes(self, tokens: int) -> float:
        """Bytes of weights one forward pass over ``tokens`` tokens reads from HBM.

        Dense models read every weight once. A MoE layer reads only the experts its
        tokens were routed to: with uniform routing, E * (1 - (1 - k/E)^t) distinct
        experts per layer for t tokens.
        """
        byte = DTYPE_BYTES[self.weight_dtype]
        if self.num_experts == 1:
            return float(self.weights_bytes)
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 1))
        per_expert = self.expert_params / e
        return byte * ((self.params_total - self.expert_params) + per_expert * touched)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank holds; heads are replicated when tp exceeds them."""
        return math.ceil(self.num_kv_heads / tp)

    def kv_bytes_per_token_per_rank(self, tp: int) -> int:
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]


class GPUSpec(_Spec):
    name: str
    memory_bytes: int = Field(gt=0)
    hbm_bandwidth: float = Field(gt=0, description="bytes/s")
    peak_flops: dict[Dtype, float] = Field(description="dense tensor-core FLOP/s per dtype")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU, one direction (NVLink)")
    network_bandwidth: float = Field(gt=0, description="bytes/s per GPU for KV transfer (RDMA NIC)")
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs a server holds, joined by intra_node_bandwidth")
    source: str
