"""Phi-3 family: the Llama architecture with q / k / v and gate / up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`: our own fused layers load them whole, splitting each part across
tensor-parallel ranks), and Mistral's sliding window when the config sets one. Rope `longrope`
(the 128k-context models) is refused: transformers switches its frequencies for a whole forward
pass by the sequence's length, which a paged cache shared across steps cannot reproduce."""

from __future__ import annotations

from executor_svc.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    STACKED_PARAMS = ()  # the checkpoint's names are ours
