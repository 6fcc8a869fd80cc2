"""Importing a Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, Gemma 3, CodeGen): its config.json as ModelArgs
fields, its weights under our names (q/k rows of an interleaved rotary reordered to halves), its special tokens, tokenizer
files and chat template. scripts/convert_checkpoint.py writes what `read_hf` returns; hf_export.py is its inverse.
"""
import json
from pathlib import Path

import torch

from chat import token_text
from checkpoint import InputError, read_json_object

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
# Our name for each per-layer Hugging Face tensor of the Llama family.
LLAMA_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
}
# Gemma 3's: Llama's, with a norm after each branch (its post_attention_layernorm is that, not the MLP's input norm)
GEMMA3_LAYER_NAMES = LLAMA_LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm"}


# Gemma3TextConfig's defaults in transformers, which a multimodal checkpoint's text_config mostly leaves out (the 4B's
# gives its sizes, layers, window and rope scaling only)
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072)
# What a multimodal Gemma 3 keeps apart from its language model (as transformers 4.5x and 5.x save them), and the
# language model's prefixes there
GEMMA3_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
GEMMA3_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                        "language_model.lm_head.": "lm_head."}

REQUIRED = object()


def require(config: dict, key: str, source, kind=int, default=REQUIRED):
    """config[key], of type kind (int: not a bool; float: an int too); default where it is absent or null."""
    value = config.get(key)
    if value is None:
        if default is REQUIRED:
            raise InputError(f"{source}: missing field '{key}'; this is not a complete Hugging Face config")
        return default
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, kinds) or (kind in (int, float) and isinstance(value, bool)):
        expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
        raise InputError(f"{source}: field '{key}' is {value!r}, not {expected}; fix the config")
    return value


def hf_model_args(config: dict, source) -> dict:
    kind = require(config, "model_type", source, str)
    if kind in LLAMA_LIKE:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise InputError(f"{source}: field 'rope_scaling' is {rope!r}, not an object; fix the config")
        theta = require(config, "rope_theta", source, float, require(rope, "rope_theta", source, float, 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type")) == "llama3" else None
        n_heads, n_layers = require(config, "num_attention_heads", source), require(config, "num_hidden_layers", source)
        # Mistral's window covers every layer; Qwen's, where it is on, the layers from max_window_layers
        window = require(config, "sliding_window", source, int, None) \
            if kind == "mistral" or config.get("use_sliding_window") else None
        first = require(config, "max_window_layers", source, int, 0) if kind != "mistral" else 0
        layer_types = None if window is None else config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        return dict(
            family="llama", vocab_size=require(config, "vocab_size", source),
            dim=require(config, "hidden_size", source), n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=require(config, "num_key_value_heads", source, int, n_heads),
            intermediate_size=require(config, "intermediate_size", source),
            norm_eps=require(config, "rms_norm_eps", source, float, 1e-6), rope_theta=theta, rope_scaling=scaling,
            qkv_bias=kind == "qwen2" or require(config, "attention_bias", source, bool, False),
            head_dim=require(config, "head_dim", source, int, None), qk_norm=kind == "qwen3",
            layer_types=layer_types, sliding_window=window,
            tie_embeddings=require(config, "tie_word_embeddings", source, bool, False),
            max_seq_len=require(config, "max_position_embeddings", source, int, 2048))
    if kind == "gemma3_text":
        return gemma3_model_args(config, source)
    if kind == "gemma3":  # the image-and-text model (4B and up): its language model alone
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise InputError(f"{source}: model_type 'gemma3' needs a 'text_config' object; fix the config")
        text = GEMMA3_TEXT_DEFAULTS | {k: v for k, v in text.items() if v is not None}
        if isinstance(config.get("tie_word_embeddings"), bool):  # the whole model's, where it says
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return gemma3_model_args(text, f"{source} (text_config)")
    if kind == "codegen":
        dim = require(config, "n_embd", source)
        n_heads = require(config, "n_head", source)
        return dict(
            family="codegen", vocab_size=require(config, "vocab_size", source), dim=dim,
            n_layers=require(config, "n_layer", source), n_heads=n_heads, n_kv_heads=n_heads,
            intermediate_size=require(config, "n_inner", source, int, 4 * dim),
            norm_eps=require(config, "layer_norm_epsilon", source, float, 1e-5),
            rope_theta=10000.0, rotary_dim=require(config, "rotary_dim", source, int, None), tie_embeddings=False,
            max_seq_len=require(config, "n_positions", source, int, 2048))
    raise InputError(f"{source}: model_type '{kind}' is not supported; supported: {', '.join(LLAMA_LIKE)}, gemma3_text, gemma3, codegen")


def gemma3_model_args(config: dict, source) -> dict:
    """Gemma 3's text model: sliding layers (every sixth full unless layer_types says), q/k norms, its own scale."""
    n_layers, n_heads = require(config, "num_hidden_layers", source), require(config, "num_attention_heads", source)
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"{source}: field 'rope_parameters' is {rope!r}, not an object; fix the config")
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = config.get("rope_scaling") or full
    if scaling.get("rope_type", scaling.get("type")) not in (None, "default", "linear"):
        raise InputError(f"{source}: Gemma 3 rope scaling {scaling!r} is not supported (only linear)")
    pattern = require(config, "sliding_window_pattern", source, int, 6)
    layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    return dict(
        family="gemma3", vocab_size=require(config, "vocab_size", source), dim=require(config, "hidden_size", source),
        n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=require(config, "num_key_value_heads", source, int, n_heads),
        intermediate_size=require(config, "intermediate_size", source),
        norm_eps=require(config, "rms_norm_eps", source, float, 1e-6),
        rope_theta=require(config, "rope_theta", source, float, require(full, "rope_theta", source, float, 1e6)),
        rope_local_theta=require(config, "rope_local_base_freq", source, float,
                                 require(local, "rope_theta", source, float, 10000.0)),
        rope_scaling=scaling if scaling.get("rope_type", scaling.get("type")) == "linear" else None,
        head_dim=require(config, "head_dim", source, int, 256), qk_norm=True,
        query_pre_attn_scalar=require(config, "query_pre_attn_scalar", source, float, 256),
        layer_types=layer_types, sliding_window=require(config, "sliding_window", source, int, 4096),
        tie_embeddings=require(config, "tie_word_embeddings", source, bool, True),
        max_seq_len=require(config, "max_position_embeddings", source, int, 32768))


def interleaved_to_half(w: torch.Tensor, n_heads: int, rotary_dim: int) -> torch.Tensor:
    """Reorder each head's rotary rows from interleaved pairs (0,1),(2,3).. to halves (0,r/2),(1,r/2+1).."""
    head_dim = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)])
    return w.reshape(n_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int, rotary_dim: int) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)])
    out = torch.empty_like(w.reshape(n_heads, head_dim, *w.shape[1:]))
    out[:, order] = w.reshape(n_heads, head_dim, *w.shape[1:])
    return out.reshape(w.shape)


def codegen_split_qkv(qkv: torch.Tensor, args: dict):
    """CodeGen fuses q, v, k (in that order) inside each of 4 model-parallel chunks of its qkv_proj."""
    mp_num, dim = 4, args["dim"]
    chunks = qkv.reshape(mp_num, 3, dim // mp_num, dim)
    q, v, k = (chunks[:, i].reshape(dim, dim) for i in range(3))
    rotary = args.get("rotary_dim") or dim // args["n_heads"]
    return (interleaved_to_half(q, args["n_heads"], rotary), interleaved_to_half(k, args["n_heads"], rotary), v)


def from_hf_state_dict(hf: dict, args: dict) -> dict:
    out = {}
    if args["family"] in ("llama", "gemma3"):
        layer_names = GEMMA3_LAYER_NAMES if args["family"] == "gemma3" else LLAMA_LAYER_NAMES
        for name, t in hf.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                out["tok_embeddings.weight"] = t
            elif name == "model.norm.weight":
                out["norm.weight"] = t
            elif name == "lm_head.weight":
                if not args["tie_embeddings"]:
                    out["output.weight"] = t
            elif name.startswith("model.layers."):
                i, rest = name[len("model.layers."):].split(".", 1)
                module, kind = rest.rsplit(".", 1)
                if module not in layer_names:
                    raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
                out[f"layers.{i}.{layer_names[module]}.{kind}"] = t
            else:
                raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
        if args["family"] == "gemma3":  # Gemma's RMSNorm scales by 1 + weight: folded here, model.py's scales by weight
            out = {name: t.float() + 1 if name.endswith("norm.weight") else t for name, t in out.items()}
        return out
    simple = {"attn.out_proj": "attention.wo", "mlp.fc_in": "feed_forward.w1", "mlp.fc_out": "feed_forward.w2",
              "ln_1": "attention_norm"}
    for name, t in hf.items():
        if name.endswith(("attn.causal_mask", "attn.masked_bias", "attn.bias")):
            continue
        if name.startswith("transformer.wte."):
            out["tok_embeddings.weight"] = t
        elif name.startswith("transformer.ln_f."):
            out["norm." + name.rsplit(".", 1)[1]] = t
        elif name.startswith("lm_head."):
            out["output." + name.rsplit(".", 1)[1]] = t
        elif name.startswith("transformer.h."):
            i, rest = name[len("transformer.h."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if module == "attn.qkv_proj":
                q, k, v = codegen_split_qkv(t, args)
                out[f"layers.{i}.attention.wq.weight"] = q
                out[f"layers.{i}.attention.wk.weight"] = k
                out[f"layers.{i}.attention.wv.weight"] = v
            elif module in simple:
                out[f"layers.{i}.{simple[module]}.{kind}"] = t
            else:
                raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
        else:
            raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
    return out


def read_hf_weights(source: Path) -> dict:
    from safetensors import safe_open
    from tqdm import tqdm
    files = sorted(source.glob("*.safetensors"))
    if files:
        weights = {}
        for f in tqdm(files, desc="reading", unit="file", disable=len(files) < 2):
            try:
                with safe_open(f, framework="pt") as sf:
                    for name in sf.keys():
                        weights[name] = sf.get_tensor(name)
            except Exception as e:
                raise InputError(f"{f}: not a readable safetensors file ({e})") from None
        return weights
    files = sorted(source.glob("pytorch_model*.bin"))
    if not files:
        raise InputError(f"{source}: no *.safetensors or pytorch_model*.bin weights found")
    weights = {}
    for f in files:
        try:  # a pickle, read once and only for tensors (weights_only); we never write pickles
            weights.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:
            raise InputError(f"{f}: not a readable PyTorch weights file ({e})") from None
    return weights


def hf_special_tokens(source: Path, config: dict) -> dict:
    eos = config.get("eos_token_id")
    gen_path = source / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = gen.get("eos_token_id", eos)
    tok_cfg_path = source / "tokenizer_config.json"
    add_bos = None
    if tok_cfg_path.is_file():
        add_bos = json.loads(tok_cfg_path.read_text()).get("add_bos_token")
    return dict(bos_token_id=config.get("bos_token_id"), eos_token_id=eos, add_bos_token=add_bos)


def hf_chat_template(source: Path) -> dict | None:
    """What a chat needs from a Hugging Face directory: its chat template (chat_template.jinja, or
    tokenizer_config.json's chat_template) and its BOS and EOS strings; None without a template."""
    config_path = source / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise InputError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: not a JSON object")
    template = config.get("chat_template")
    if (source / "chat_template.json").is_file():  # a multimodal model's processor keeps it there
        template = read_json_object(source / "chat_template.json", "fix or remove it").get("chat_template", template)
    if (source / "chat_template.jinja").is_file():
        template = (source / "chat_template.jinja").read_text()
    if not template:
        return None
    return dict(chat_template=template, bos_token=token_text(config.get("bos_token")),
                eos_token=token_text(config.get("eos_token")))


def read_hf(source: Path):
    """A Hugging Face directory -> (ModelArgs fields, weights by our names, special tokens, tokenizer files, chat)."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise InputError(f"{config_path}: not found; --source must be a Hugging Face model directory or a .gguf file")
    config = read_json_object(config_path, "--source must be a Hugging Face model directory or a .gguf file")
    args = hf_model_args(config, config_path)
    weights = read_hf_weights(source)
    if config.get("model_type") == "gemma3":
        weights = gemma3_text_weights(weights)
        config = {**config["text_config"], **{k: v for k, v in config.items() if k.endswith("_token_id")}}
    weights = from_hf_state_dict(weights, args)
    tokenizer_files = [source / n for n in ("tokenizer.json", "tokenizer.model") if (source / n).is_file()]
    return args, weights, hf_special_tokens(source, config), tokenizer_files, hf_chat_template(source)


def gemma3_text_weights(weights: dict) -> dict:
    """A multimodal Gemma 3's language model under a text model's names; its vision tower and projector dropped."""
    out = {}
    for name, t in weights.items():
        if name.startswith(GEMMA3_NOT_TEXT):
            continue
        prefix = next((p for p in GEMMA3_TEXT_PREFIXES if name.startswith(p)), None)
        out[GEMMA3_TEXT_PREFIXES[prefix] + name[len(prefix):] if prefix else name] = t
    return out
