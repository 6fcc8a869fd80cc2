"""Exporting one of our models to `transformers` (the inverse of hf_import.py): the independent reference that the
tests and scripts/bench.py run beside model.py.
"""
import torch

import cli
from hf_import import GEMMA3_LAYER_NAMES, LLAMA_LAYER_NAMES, half_to_interleaved
from model import ModelArgs

def hf_config(args: ModelArgs):
    """A `transformers` config for a converted checkpoint (the inverse of hf_model_args)."""
    cli.require("transformers", "the transformers reference")
    from transformers import CodeGenConfig, LlamaConfig
    if args.family == "codegen":
        return CodeGenConfig(vocab_size=args.vocab_size, n_embd=args.dim, n_layer=args.n_layers, n_head=args.n_heads,
                             n_inner=args.intermediate_size, rotary_dim=args.rotary_dim,
                             layer_norm_epsilon=args.norm_eps, n_positions=args.max_seq_len, n_ctx=args.max_seq_len,
                             activation_function="gelu_new", tie_word_embeddings=False)
    rope = dict(args.rope_scaling or {"rope_type": "default"}, rope_theta=args.rope_theta)
    if args.family == "gemma3":
        from transformers import Gemma3TextConfig
        local = dict(rope_type="default", rope_theta=args.rope_local_theta or args.rope_theta)
        return Gemma3TextConfig(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                                num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                                head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                                rms_norm_eps=args.norm_eps, rope_parameters=dict(full_attention=rope,
                                                                                 sliding_attention=local),
                                query_pre_attn_scalar=args.query_pre_attn_scalar or args.head_dim,
                                layer_types=args.layer_kinds(), sliding_window=args.sliding_window or 4096,
                                tie_word_embeddings=args.tie_embeddings, max_position_embeddings=args.max_seq_len,
                                pad_token_id=None)
    if args.qk_norm:
        from transformers import Qwen3Config
        return Qwen3Config(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                           num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                           head_dim=args.head_dim, intermediate_size=args.intermediate_size, rms_norm_eps=args.norm_eps,
                           rope_parameters=rope, attention_bias=args.qkv_bias, tie_word_embeddings=args.tie_embeddings,
                           max_position_embeddings=args.max_seq_len, use_sliding_window=False)
    if args.qkv_bias:  # Llama's attention_bias would add one to o_proj too; Qwen2 has q/k/v biases only
        from transformers import Qwen2Config
        return Qwen2Config(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                           num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                           head_dim=args.head_dim, intermediate_size=args.intermediate_size, rms_norm_eps=args.norm_eps,
                           rope_parameters=rope, tie_word_embeddings=args.tie_embeddings,
                           max_position_embeddings=args.max_seq_len, use_sliding_window=False)
    if "sliding_attention" in args.layer_kinds():  # Llama has no window; Mistral's covers every layer
        if set(args.layer_kinds()) != {"sliding_attention"}:
            raise cli.InputError("a Llama-family model windowed on some layers only has no transformers config here")
        from transformers import MistralConfig
        return MistralConfig(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                             num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                             head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                             rms_norm_eps=args.norm_eps, rope_parameters=rope, sliding_window=args.sliding_window,
                             tie_word_embeddings=args.tie_embeddings, max_position_embeddings=args.max_seq_len)
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                       num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                       head_dim=args.head_dim, intermediate_size=args.intermediate_size, rms_norm_eps=args.norm_eps,
                       rope_parameters=rope, attention_bias=args.qkv_bias, mlp_bias=False,
                       tie_word_embeddings=args.tie_embeddings, max_position_embeddings=args.max_seq_len)


def to_hf_model(model):
    """A `transformers` model with the weights of one of ours (fp32 reference runs, the bench's baseline)."""
    transformers = cli.require("transformers", "the transformers reference")
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model.args), dtype=model.output.weight.dtype)
    state = {k: v for k, v in model.state_dict().items() if not (k == "output.weight" and model.args.tie_embeddings)}
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(state, model.args), strict=False)
    assert not unexpected and all("rotary" in m or "causal_mask" in m or "masked_bias" in m for m in missing), \
        (missing, unexpected)
    return hf.eval()


def to_hf_state_dict(ours: dict, args: ModelArgs) -> dict:
    """The inverse of from_hf_state_dict: lets `transformers` run a converted checkpoint (bench, tests)."""
    hf = {}
    if args.family in ("llama", "gemma3"):
        inverse = {v: k for k, v in (GEMMA3_LAYER_NAMES if args.family == "gemma3" else LLAMA_LAYER_NAMES).items()}
        if args.family == "gemma3":  # the inverse of the import's fold: Gemma's RMSNorm scales by 1 + weight
            ours = {name: t - 1 if name.endswith("norm.weight") else t for name, t in ours.items()}
        for name, t in ours.items():
            if name == "tok_embeddings.weight":
                hf["model.embed_tokens.weight"] = t
            elif name == "norm.weight":
                hf["model.norm.weight"] = t
            elif name == "output.weight":
                hf["lm_head.weight"] = t
            else:
                _, i, rest = name.split(".", 2)
                module, kind = rest.rsplit(".", 1)
                hf[f"model.layers.{i}.{inverse[module]}.{kind}"] = t
        if args.tie_embeddings:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf
    simple = {"attention.wo": "attn.out_proj", "feed_forward.w1": "mlp.fc_in", "feed_forward.w2": "mlp.fc_out",
              "attention_norm": "ln_1"}
    for name, t in ours.items():
        if name == "tok_embeddings.weight":
            hf["transformer.wte.weight"] = t
        elif name.startswith("norm."):
            hf["transformer.ln_f." + name.split(".")[1]] = t
        elif name.startswith("output."):
            hf["lm_head." + name.split(".")[1]] = t
        else:
            _, i, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            if module in simple:
                hf[f"transformer.h.{i}.{simple[module]}.{kind}"] = t
    for i in range(args.n_layers):
        q, k, v = (half_to_interleaved(ours[f"layers.{i}.attention.w{x}.weight"], args.n_heads, args.rotary_dim)
                   if x != "v" else ours[f"layers.{i}.attention.wv.weight"] for x in "qkv")
        mp_num = 4
        parts = [t.reshape(mp_num, args.dim // mp_num, args.dim) for t in (q, v, k)]
        hf[f"transformer.h.{i}.attn.qkv_proj.weight"] = torch.stack(parts, 1).reshape(3 * args.dim, args.dim)
    return hf
