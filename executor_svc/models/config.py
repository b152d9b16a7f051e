"""What the executor needs to know about a model, read from a Hugging Face `config.json`.

One frozen dataclass for every family; family-specific switches (biases, q/k norm, OPT's layer-norm
placement) are plain fields so a model file never reads the raw JSON.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

import torch

from executor_svc.models.families import UnsupportedArchitectureError, family_of

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "opt", "phi3", "granite")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")

# the names of runner/cache_config.DTYPE_NAMES
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """config.json describes something this executor cannot serve."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding and its context-extension scaling, as HF's `rope_parameters` name them.
    `dynamic` (NTK) scales only past max_position_embeddings, which is also our max_model_len, so it
    is plain rope wherever we serve; `yarn` blends interpolated and original frequencies between the
    beta_fast / beta_slow rotation counts and scales cos / sin by `attention_factor` (None: HF's
    default from `factor`, `mscale`, `mscale_all_dim`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear" | "dynamic" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"rope_type {self.rope_type!r} is not supported (supported: {ROPE_TYPES})")
        if not (self.theta > 1.0 and self.factor > 0.0 and self.original_max_position_embeddings >= 1):
            raise ModelConfigError(
                f"rope: theta {self.theta} must be > 1, factor {self.factor} > 0, "
                f"original_max_position_embeddings {self.original_max_position_embeddings} >= 1"
            )


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts feed-forward: each token takes its `top_k` experts of `num_experts` by the
    router's softmax (renormalized over the top k or not), plus Qwen2-MoE's sigmoid-gated shared
    expert that every token takes. Layers in `dense_layers`, or not on the `sparse_step`, are dense."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}")
        if min(self.intermediate_size, self.sparse_step) < 1 or self.shared_expert_intermediate_size < 0:
            raise ModelConfigError("expert sizes and decoder_sparse_step must be positive")

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers and (layer_index + 1) % self.sparse_step == 0


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma 2 / 3: attention scaled by query_pre_attn_scalar ** -0.5, a sliding window per layer
    (0: global), attention and final logits soft-capped (0: not), and Gemma 3's own rope for its
    sliding layers (`local_rope`; the global layers use ModelConfig.rope)."""

    query_pre_attn_scalar: float
    layer_windows: tuple[int, ...]
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    local_rope: RopeConfig | None = None

    def __post_init__(self) -> None:
        if not self.query_pre_attn_scalar > 0 or min(self.layer_windows, default=0) < 0:
            raise ModelConfigError("query_pre_attn_scalar must be > 0 and sliding_window >= 1")
        if not (self.attn_logit_softcap >= 0 and self.final_logit_softcap >= 0):
            raise ModelConfigError("logit soft-capping values must be > 0 or null")


@dataclass(frozen=True, slots=True)
class GraniteConfig:
    """Granite: Llama with embeddings times embedding_multiplier, attention scaled by
    attention_multiplier, each block's output times residual_multiplier, logits / logits_scaling."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        values = (self.embedding_multiplier, self.attention_multiplier, self.residual_multiplier)
        if not all(math.isfinite(v) for v in values) or not self.logits_scaling > 0:
            raise ModelConfigError("Granite's multipliers must be finite and logits_scaling > 0")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # > 0: a position attends to the last this many positions (Mistral)
    tie_word_embeddings: bool = False
    # OPT only.
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    layer_norm_elementwise_affine: bool = True
    moe: MoeConfig | None = None  # the MoE families only
    gemma: GemmaConfig | None = None  # the Gemma families only
    granite: GraniteConfig | None = None  # Granite only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in

    def __post_init__(self) -> None:
        if self.family not in (*DENSE_FAMILIES, *MOE_FAMILIES, *GEMMA_FAMILIES):
            raise ModelConfigError(f"unknown model family {self.family!r}")
        if (self.moe is None) == (self.family in MOE_FAMILIES):
            what = "needs" if self.moe is None else "has no"
            raise ModelConfigError(f"family {self.family!r} {what} experts")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}"
            )
        if min(self.vocab_size, self.hidden_size, self.num_layers, self.head_dim, self.max_model_len) < 1:
            raise ModelConfigError("sizes must be positive")

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> ModelConfig:
        path = pathlib.Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} not found")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        family = _family(hf)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            max_model_len=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", family in ("opt", *GEMMA_FAMILIES)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )
        if family == "opt":
            if not hf.get("enable_bias", True):
                raise ModelConfigError("OPT without biases (enable_bias=false) is not supported")
            return cls(
                **common,
                num_kv_heads=num_heads,
                head_dim=hf["hidden_size"] // num_heads,
                intermediate_size=hf["ffn_dim"],
                norm_eps=1e-5,
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                do_layer_norm_before=hf.get("do_layer_norm_before", True),
                word_embed_proj_dim=hf.get("word_embed_proj_dim", hf["hidden_size"]),
                layer_norm_elementwise_affine=hf.get("layer_norm_elementwise_affine", True),
            )
        if family in GEMMA_FAMILIES:
            return cls(**common, **_gemma(hf, family, num_heads))
        if hf.get("use_sliding_window", False):
            raise ModelConfigError("sliding-window attention is not supported")
        window = hf.get("sliding_window") if family in ("llama", "phi3") else None  # on every layer
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ModelConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {hf.get('hidden_act')!r} is not supported")
        attention_bias = hf.get("attention_bias", False)
        return cls(
            **common,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_rope(hf),
            qkv_bias=family == "qwen2" or attention_bias or _qwen2_moe_bias(hf, family),
            o_bias=attention_bias,
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=window if window is not None and window < common["max_model_len"] else 0,
            moe=_moe(hf, family),
            granite=_granite(hf) if family == "granite" else None,
        )


def _gemma(hf: dict, family: str, num_heads: int) -> dict:
    """The ModelConfig fields of a Gemma 2 / Gemma 3 (text) config: GeGLU (gelu_pytorch_tanh), the
    layer types (Gemma 2: sliding on even layers; Gemma 3: every sliding_window_pattern-th global),
    and Gemma 3's rope per layer type (`rope_parameters` keyed by it, or rope_local_base_freq)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = 2 if family == "gemma2" else hf.get("sliding_window_pattern", 6)
        is_full = [(i + 1) % pattern == 0 for i in range(num_layers)]
        layer_types = ["full_attention" if full else "sliding_attention" for full in is_full]
    known = ("sliding_attention", "full_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(
        t not in known for t in layer_types
    ):
        raise ModelConfigError(f"layer_types {layer_types!r}: one of {known} per layer")
    window = hf.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise ModelConfigError(f"sliding_window must be a positive integer, got {window!r}")
    params = hf.get("rope_parameters") or {}
    local_rope = None
    if family == "gemma3":
        if "full_attention" in params:
            rope = _rope(hf | {"rope_parameters": params["full_attention"]})
            local_rope = _rope(hf | {"rope_parameters": params.get("sliding_attention") or {}})
        else:
            rope = _rope(hf)
            local_rope = RopeConfig(theta=hf.get("rope_local_base_freq", 10000.0))
    else:
        rope = _rope(hf)
    gemma = GemmaConfig(
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        attn_logit_softcap=hf.get("attn_logit_softcapping") or 0.0,
        final_logit_softcap=hf.get("final_logit_softcapping") or 0.0,
        local_rope=local_rope,
    )
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=rope,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=family == "gemma3",
        gemma=gemma,
    )


def _granite(hf: dict) -> GraniteConfig:
    return GraniteConfig(
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )


def _qwen2_moe_bias(hf: dict, family: str) -> bool:
    return family == "qwen2_moe" and bool(hf.get("qkv_bias", True))


def _moe(hf: dict, family: str) -> MoeConfig | None:
    """Mixtral routes over `num_local_experts` and always renormalizes; Qwen MoE reads
    `norm_topk_prob` and its dense layers; Qwen2-MoE adds the shared expert."""
    if family not in MOE_FAMILIES:
        return None
    try:
        return _read_moe(hf, family)
    except KeyError as err:
        raise ModelConfigError(f"a {family} config.json needs {err.args[0]!r}") from None


def _read_moe(hf: dict, family: str) -> MoeConfig:
    if family == "mixtral":
        window = hf.get("sliding_window")
        if window is not None and window < hf.get("max_position_embeddings", 2048):  # as Mistral's
            raise ModelConfigError(f"Mixtral with sliding_window {window} is not supported")
        return MoeConfig(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], True)
    return MoeConfig(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf["shared_expert_intermediate_size"] if family == "qwen2_moe" else 0,
        sparse_step=hf.get("decoder_sparse_step", 1),
        dense_layers=tuple(hf.get("mlp_only_layers") or ()),
    )


def _family(hf: dict) -> str:
    try:
        return family_of(hf)
    except UnsupportedArchitectureError as err:
        raise ModelConfigError(str(err)) from None


def _rope(hf: dict) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor {partial} is not supported (only whole-head rotary)")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    max_positions = hf.get("max_position_embeddings", 8192)
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    original = original or max_positions
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=params.get("low_freq_factor", 1.0),
        high_freq_factor=params.get("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale") or 0.0,
        mscale_all_dim=params.get("mscale_all_dim") or 0.0,
        truncate=params.get("truncate", True),
    )
