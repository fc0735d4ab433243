"""The roofline's view of a mixture-of-experts model: how many expert weights a step
multiplies by (FLOPs) and reads (bytes), against a dense model's every weight.

A token runs only its `top_k` experts of each sparse layer, so its matmul FLOPs
count `top_k` experts' weights per sparse layer, not all `num_experts`. A step
reads each expert that at least one of its tokens picked. One token reads
exactly `top_k`; for B tokens the count depends on the routing, and the floor
takes its expectation under uniform, independent routing (each token picks a
uniformly random set of `top_k` experts):

    E[distinct] = num_experts * (1 - (1 - top_k / num_experts) ** B)

Real routers are skewed towards some experts, which touches fewer distinct
experts than this at the same B, so at large B the floor's bytes can be high by
up to the ratio of this figure to the experts actually hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.models.moe_weights import MoEArch


@dataclass(frozen=True)
class ExpertCounts:
    """One model's routed experts, read from its Hugging Face config."""

    num_experts: int
    top_k: int
    params_per_expert: int  # gate, up and down of one expert
    sparse_layers: int
    last_sparse: bool  # the last layer's MLP runs only at the sampled rows

    @property
    def all_expert_params(self) -> int:
        return self.sparse_layers * self.num_experts * self.params_per_expert

    @property
    def routed_params(self) -> int:
        """Expert weights one token's matmuls multiply by (`top_k` per sparse layer)."""
        return self.sparse_layers * self.top_k * self.params_per_expert

    def read_params(self, tokens: float, rows: float) -> float:
        """Expert weights a step of `tokens` tokens reads (expected distinct experts), the
        last layer's for its `rows` sampled rows."""
        def distinct(n: float) -> float:
            return expected_distinct_experts(self.num_experts, self.top_k, n)

        last = int(self.last_sparse)
        return self.params_per_expert * ((self.sparse_layers - last) * distinct(tokens)
                                         + last * distinct(rows))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Experts picked by at least one of `tokens` tokens under uniform routing (see above)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expert_counts(hf_config: Any) -> ExpertCounts | None:
    """None for a dense model."""
    moe = MoEArch.from_hf_config(hf_config)
    if moe is None:
        return None
    return ExpertCounts(num_experts=moe.num_experts, top_k=moe.top_k,
                        params_per_expert=3 * int(hf_config.hidden_size) * moe.intermediate_size,
                        sparse_layers=sum(moe.sparse_layers),
                        last_sparse=moe.sparse_layers[-1])


def last_layer_mlp_params(hf_config: Any) -> int:
    """The matmul weights one token multiplies by in the last layer's MLP: the dense
    MLP's, or the router's and `top_k` experts' where the last layer is sparse."""
    hidden = int(hf_config.hidden_size)
    moe = MoEArch.from_hf_config(hf_config)
    if moe is None or not moe.sparse_layers[-1]:
        return 3 * hidden * int(hf_config.intermediate_size)
    return moe.num_experts * hidden + moe.top_k * 3 * hidden * moe.intermediate_size
