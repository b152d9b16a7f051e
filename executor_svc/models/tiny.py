"""Write a tiny but real Hugging Face model folder: config.json of the real architecture, random
weights in safetensors, and a byte-level BPE tokenizer trained on `assets/corpus.txt`.

The folder loads with `transformers.AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` and with
our own loader; the same (family, seed) always gives byte-identical files.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = pathlib.Path(__file__).parent / "assets" / "corpus.txt"
FAMILIES = (
    "llama", "qwen2", "qwen3", "opt", "mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "phi3",
    "granite",
)
VOCAB_SIZE = 512
# Special tokens take ids 0, 1, 2: (pad, bos, eos) as Llama/OPT name them; Qwen's tokenizer class
# insists on <|endoftext|> (its pad = eos = unk), so Qwen folders use Qwen's names.
SPECIAL_TOKENS = {
    "llama": {"pad": ("<pad>", 0), "bos": ("<s>", 1), "eos": ("</s>", 2), "extra": ()},
    "qwen": {
        "pad": ("<|endoftext|>", 0),
        "bos": ("<|im_start|>", 1),
        "eos": ("<|endoftext|>", 0),
        "extra": ("<|im_end|>",),
    },
}
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, MAX_POS = 64, 2, 4, 2, 128, 2048
# A small chat template (tokenizer_config.json), so that chat requests work on the tiny model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 4, 2, 32, 48


def make_tiny_model(
    model_dir: str | pathlib.Path, family: str = "llama", seed: int = 0, **config_overrides
) -> pathlib.Path:
    """Writes the folder and returns its path. `config_overrides` replace config.json fields (e.g. an
    OPT-350m-like `do_layer_norm_before=False, word_embed_proj_dim=32`); weights follow the config."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    folder = pathlib.Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family)
    specials = _specials(family)
    config |= {
        "pad_token_id": specials["pad"][1],
        "bos_token_id": specials["bos"][1],
        "eos_token_id": specials["eos"][1],
    }
    config |= config_overrides
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tiny_weights(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, specials, add_bos=family in ("llama", "opt", "mixtral"))
    return folder


def tiny_config(family: str) -> dict:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "max_position_embeddings": MAX_POS,
        "dtype": "float32",
    }
    if family == "opt":
        return common | {
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "ffn_dim": FFN,
            "do_layer_norm_before": True,
            "word_embed_proj_dim": HIDDEN,
            "enable_bias": True,
            "activation_function": "relu",
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "layer_norm_elementwise_affine": True,
            "tie_word_embeddings": True,
        }
    llama_like = common | {
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": FFN,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
    }
    if family == "llama":  # llama3 rope scaling with a short original context, so it really changes freqs
        return llama_like | {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    if family in ("gemma2", "gemma3"):
        return _gemma_config(family, llama_like)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    if family == "phi3":  # q / k / v and gate / up fused in the checkpoint
        return llama_like | rope | {
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "tie_word_embeddings": False,
            "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        }
    if family == "granite":  # multipliers far from 1, so that each one matters
        return llama_like | rope | {
            "architectures": ["GraniteForCausalLM"], "model_type": "granite", "tie_word_embeddings": True,
            "embedding_multiplier": 6.0, "attention_multiplier": 0.1, "residual_multiplier": 0.3,
            "logits_scaling": 2.0, "attention_bias": False, "mlp_bias": False,
        }
    if family in ("mixtral", "qwen3_moe", "qwen2_moe"):
        return llama_like | rope | _moe_config(family)
    if family == "qwen2":
        return (
            llama_like
            | rope
            | {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "use_sliding_window": False,
                "tie_word_embeddings": True,
            }
        )
    return (
        llama_like
        | rope
        | {  # qwen3: head_dim 32 != hidden / heads
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "head_dim": 32,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        }
    )


def _moe_config(family: str) -> dict:
    """Mixtral: every layer sparse, renormalized top-k. Qwen3-MoE: head_dim 32, norm_topk_prob, layer 1
    dense (mlp_only_layers). Qwen2-MoE: no renormalization, the sigmoid-gated shared expert."""
    if family == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "intermediate_size": EXPERT_FFN,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "tie_word_embeddings": False,
        }
    qwen = {
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": EXPERT_FFN,
        "decoder_sparse_step": 1,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    if family == "qwen3_moe":
        return qwen | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": 32,
            "attention_bias": False,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        }
    return qwen | {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "norm_topk_prob": False,
        "shared_expert_intermediate_size": SHARED_FFN,
        "mlp_only_layers": [],
    }


def tiny_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the HF names; scales keep logits well spread (std about 4)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _opt_shapes(config) if config["model_type"] == "opt" else _llama_shapes(config)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "layer_norm.weight")):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            value = 0.1 * torch.randn(shape, generator=gen)
        elif "embed" in name or name == "lm_head.weight":
            value = 0.5 * torch.randn(shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        weights[name] = value.contiguous()
    return weights


def _llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", d // h)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h * hd, d),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.o_proj.weight": (d, h * hd),
            **_mlp_shapes(c, i, p),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
        if c["model_type"] in ("qwen2", "qwen2_moe"):
            shapes |= {p + f"self_attn.{x}_proj.bias": (n * hd,) for x, n in (("q", h), ("k", kv), ("v", kv))}
        if c["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if c["model_type"].startswith("gemma"):
            shapes |= {p + f"{x}_feedforward_layernorm.weight": (d,) for x in ("pre", "post")}
    shapes["model.norm.weight"] = (d,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], d)
    return _fused_phi3(shapes, c) if c["model_type"] == "phi3" else shapes


def _fused_phi3(shapes: dict[str, tuple[int, ...]], c: dict) -> dict[str, tuple[int, ...]]:
    """Phi-3's names: [q; k; v] as self_attn.qkv_proj, [gate; up] as mlp.gate_up_proj."""
    fused: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            kv_rows = 2 * shapes[name.replace(".q_proj.", ".k_proj.")][0]
            fused[name.replace(".q_proj.", ".qkv_proj.")] = (shape[0] + kv_rows, shape[1])
        elif ".gate_proj." in name:
            fused[name.replace(".gate_proj.", ".gate_up_proj.")] = (2 * shape[0], shape[1])
        else:
            fused[name] = shape
    return fused


def _gemma_config(family: str, llama_like: dict) -> dict:
    """Layer 0 sliding (window 8, shorter than the test prompts), layer 1 global; head_dim 32 and
    query_pre_attn_scalar 24 (neither hidden / heads); soft caps low enough to bite on tiny logits;
    Gemma 3: no attention cap, q / k norms, a local rope base and linear scaling on the global layer."""
    config = {k: v for k, v in llama_like.items() if k != "hidden_act"} | {
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 3.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
    }
    if family == "gemma2":
        return config | {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "attn_logit_softcapping": 2.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    return config | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attn_logit_softcapping": None,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    }


def _mlp_shapes(c: dict, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """The feed-forward of one layer under the HF names: dense, or the router and each expert."""
    d, model_type = c["hidden_size"], c["model_type"]

    def gated(p: str, ffn: int, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, tuple[int, ...]]:
        gate, up, down = names
        return {f"{p}{gate}.weight": (ffn, d), f"{p}{up}.weight": (ffn, d), f"{p}{down}.weight": (d, ffn)}

    sparse = model_type == "mixtral" or (
        model_type.endswith("_moe") and layer not in c.get("mlp_only_layers", [])
        and (layer + 1) % c.get("decoder_sparse_step", 1) == 0
    )
    if not sparse:
        return gated(prefix + "mlp.", c["intermediate_size"])
    if model_type == "mixtral":
        p, num_experts = prefix + "block_sparse_moe.", c["num_local_experts"]
        shapes = {p + "gate.weight": (num_experts, d)}
        for e in range(num_experts):
            shapes |= gated(f"{p}experts.{e}.", c["intermediate_size"], ("w1", "w3", "w2"))
        return shapes
    p, num_experts = prefix + "mlp.", c["num_experts"]
    shapes = {p + "gate.weight": (num_experts, d)}
    for e in range(num_experts):
        shapes |= gated(f"{p}experts.{e}.", c["moe_intermediate_size"])
    if model_type == "qwen2_moe":
        shapes |= gated(p + "shared_expert.", c["shared_expert_intermediate_size"])
        shapes[p + "shared_expert_gate.weight"] = (1, d)
    return shapes


def _opt_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d, f, e = c["hidden_size"], c["ffn_dim"], c["word_embed_proj_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.decoder.embed_tokens.weight": (c["vocab_size"], e),
        "model.decoder.embed_positions.weight": (c["max_position_embeddings"] + 2, d),
    }
    if e != d:
        shapes |= {"model.decoder.project_in.weight": (d, e), "model.decoder.project_out.weight": (e, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.decoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {p + f"self_attn.{proj}.weight": (d, d), p + f"self_attn.{proj}.bias": (d,)}
        shapes |= {
            p + "fc1.weight": (f, d),
            p + "fc1.bias": (f,),
            p + "fc2.weight": (d, f),
            p + "fc2.bias": (d,),
        }
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes |= {p + f"{norm}.weight": (d,), p + f"{norm}.bias": (d,)}
    if c["do_layer_norm_before"]:  # OPT-350m (post-LN) has no final norm
        shapes |= {"model.decoder.final_layer_norm.weight": (d,), "model.decoder.final_layer_norm.bias": (d,)}
    if not c.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (c["vocab_size"], e)
    return shapes


def _specials(family: str) -> dict:
    return SPECIAL_TOKENS["qwen" if family.startswith("qwen") else "llama"]


def _special_list(specials: dict) -> list[str]:
    ordered = [specials["pad"][0], specials["bos"][0], specials["eos"][0], *specials["extra"]]
    return list(dict.fromkeys(ordered))  # ids 0, 1, 2 in this order


def train_tokenizer(specials: dict, add_bos: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_special_list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    if add_bos:
        bos, bos_id = specials["bos"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def write_tokenizer(folder: pathlib.Path, specials: dict, add_bos: bool) -> None:
    tokenizer = train_tokenizer(specials, add_bos)
    for key in ("pad", "bos", "eos"):
        token, token_id = specials[key]
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"{key} token {token!r} did not get id {token_id}")
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials["bos"][0],
        "eos_token": specials["eos"][0],
        "pad_token": specials["pad"][0],
        "add_bos_token": add_bos,
        "model_max_length": MAX_POS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )
