"""Convert a Hugging Face model directory or a .gguf file into this project's checkpoint layout.

    python scripts/convert_checkpoint.py --source SRC --output_dir OUT

OUT receives config.json (ModelArgs fields plus tokenizer ids), model.safetensors and the tokenizer
(tokenizer.json or tokenizer.model). Every file is written to a temporary name and renamed, the config last,
so a directory with a config.json is always complete.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402

from chat import token_text  # noqa: E402
from checkpoint import (InputError, OneLineErrors, check_model_args, write_atomically,  # noqa: E402
                        write_safetensors)
from model import ModelArgs  # noqa: E402

TOOL = "scripts/convert_checkpoint.py"

LLAMA_LIKE = ("llama", "mistral", "qwen2")
# Our name for each per-layer Hugging Face tensor of the Llama family.
LLAMA_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_ARCHITECTURES = ("llama", "qwen2")
GGUF_LAYER_NAMES = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
}


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


# ---------------------------------------------------------------- Hugging Face directories

def hf_model_args(config: dict, source) -> dict:
    kind = require(config, "model_type", source, str)
    if kind in LLAMA_LIKE:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise InputError(f"{source}: field 'rope_scaling' is {rope!r}, not an object; fix the config")
        theta = require(config, "rope_theta", source, float, require(rope, "rope_theta", source, float, 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type")) == "llama3" else None
        n_heads = require(config, "num_attention_heads", source)
        return dict(
            family="llama", vocab_size=require(config, "vocab_size", source),
            dim=require(config, "hidden_size", source), n_layers=require(config, "num_hidden_layers", source),
            n_heads=n_heads, n_kv_heads=require(config, "num_key_value_heads", source, int, n_heads),
            intermediate_size=require(config, "intermediate_size", source),
            norm_eps=require(config, "rms_norm_eps", source, float, 1e-6), rope_theta=theta, rope_scaling=scaling,
            qkv_bias=kind == "qwen2" or require(config, "attention_bias", source, bool, False),
            tie_embeddings=require(config, "tie_word_embeddings", source, bool, False),
            max_seq_len=require(config, "max_position_embeddings", source, int, 2048))
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
    raise InputError(f"{source}: model_type '{kind}' is not supported; supported: {', '.join(LLAMA_LIKE)}, codegen")


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
    if args["family"] == "llama":
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
                if module not in LLAMA_LAYER_NAMES:
                    raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
                out[f"layers.{i}.{LLAMA_LAYER_NAMES[module]}.{kind}"] = t
            else:
                raise InputError(f"unexpected tensor '{name}' in the source checkpoint")
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
    if args.qkv_bias:  # Llama's attention_bias would add one to o_proj too; Qwen2 has q/k/v biases only
        from transformers import Qwen2Config
        return Qwen2Config(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                           num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                           intermediate_size=args.intermediate_size, rms_norm_eps=args.norm_eps,
                           rope_parameters=rope, tie_word_embeddings=args.tie_embeddings,
                           max_position_embeddings=args.max_seq_len, use_sliding_window=False)
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                       num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                       intermediate_size=args.intermediate_size, rms_norm_eps=args.norm_eps,
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
    if args.family == "llama":
        inverse = {v: k for k, v in LLAMA_LAYER_NAMES.items()}
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
    if (source / "chat_template.jinja").is_file():
        template = (source / "chat_template.jinja").read_text()
    if not template:
        return None
    return dict(chat_template=template, bos_token=token_text(config.get("bos_token")),
                eos_token=token_text(config.get("eos_token")))


def convert_hf(source: Path):
    config_path = source / "config.json"
    if not config_path.is_file():
        raise InputError(f"{config_path}: not found; --source must be a Hugging Face model directory or a .gguf file")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: not a JSON object")
    args = hf_model_args(config, config_path)
    weights = from_hf_state_dict(read_hf_weights(source), args)
    tokenizer_files = [source / n for n in ("tokenizer.json", "tokenizer.model") if (source / n).is_file()]
    return args, weights, hf_special_tokens(source, config), tokenizer_files, hf_chat_template(source)


# ---------------------------------------------------------------- GGUF

def gguf_value(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# llama.cpp's BPE pre-tokenizers (tokenizer.ggml.pre), for the architectures converted here: the regexes it splits text
# with, one after the other (each splits the pieces of the one before), and whether a piece that is a whole token
# skips the merges (its ignore_merges). GPT-2's: contractions, letters, digits and other characters, each with one
# leading space; whitespace runs. Llama 3's and Qwen2's: contractions in either case, letters with one leading
# non-letter, digits in runs of at most three (Qwen2: one), punctuation runs with their newlines, newline runs, spaces.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
    "gpt-2": ([GPT2_SPLIT], False),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), ([LLAMA3_SPLIT], True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), ([QWEN2_SPLIT], False)),
    **dict.fromkeys(("smollm", "starcoder"), ([r"\p{N}", GPT2_SPLIT], False)),
}
LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")  # llama.cpp adds BOS to these unless the file says otherwise
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)  # GGUF token types, as SentencePiece's
# The tokens llama.cpp ends generation at besides the file's EOS (its end-of-generation list): Qwen2.5-Coder's
# completions end with <|endoftext|> while its EOS is <|im_end|>.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
                     "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|fim_pad|>", "<|repo_name|>",
                     "<|file_sep|>")


def gguf_end_of_generation(reader) -> list[int]:
    """The file's EOS, EOT and EOM ids, and its control tokens that llama.cpp treats as end of generation."""
    ids = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = gguf_value(reader, "tokenizer.ggml.tokens") or []
    types = gguf_value(reader, "tokenizer.ggml.token_type") or []
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)
            and t in END_OF_GENERATION]
    return sorted({i for i in ids if i is not None})


def gguf_tokenizer(reader, path: Path):
    """The tokenizer llama.cpp builds from the file's vocabulary, as a `tokenizers` Tokenizer: byte-level BPE
    (tokenizer.ggml.model "gpt2") with the pre-tokenizer the file names, or SentencePiece ("llama")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    kind = gguf_value(reader, "tokenizer.ggml.model")
    tokens, types = gguf_value(reader, "tokenizer.ggml.tokens"), gguf_value(reader, "tokenizer.ggml.token_type")
    if kind == "llama":
        tok = sentencepiece_tokenizer(tokens, gguf_value(reader, "tokenizer.ggml.scores"), types,
                                      gguf_value(reader, "tokenizer.ggml.unknown_token_id"),
                                      bool(gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)))
    elif kind == "gpt2":
        pre = gguf_value(reader, "tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise InputError(f"{path}: pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported "
                             f"({', '.join(PRE_TOKENIZERS)}); convert the Hugging Face directory of this model instead")
        splits, ignore_merges = PRE_TOKENIZERS[pre]
        merges = [tuple(m.split(" ", 1)) for m in gguf_value(reader, "tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        raise InputError(f"{path}: embedded tokenizer '{kind}' (tokenizer.ggml.model) is not supported (gpt2: "
                         "byte-level BPE, llama: SentencePiece); convert the Hugging Face directory of this model "
                         "instead")
    # Never split and never made from plain text; llama.cpp finds them in a prompt (parse_special)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (UNKNOWN, CONTROL, USER_DEFINED)])
    return tok


def sentencepiece_tokenizer(tokens, scores, types, unknown_id, add_space_prefix):
    """llama.cpp's SentencePiece tokenizer: a text between special tokens gets a leading space (add_space_prefix),
    spaces become U+2581, then adjacent pieces merge while their concatenation is a token, highest score first;
    a character that is no token becomes its bytes' <0xXX> tokens. As BPE: every way to cut a token into two tokens
    is a merge, ranked by the token's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((t[:k], t[k:]) for t in tokens for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab),
                    key=lambda m: (-scores[vocab[m[0] + m[1]]], vocab[m[0] + m[1]]))
    unknown = tokens[unknown_id] if unknown_id is not None and unknown_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, byte_fallback=BYTE in types,
                               fuse_unk=True))
    space = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if add_space_prefix else []) + space)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def gguf_reader(path):
    """gguf's GGUFReader, reading through a plain array view of its memory map: slicing a np.memmap runs numpy's
    Python hooks for every slice, and a 150k-token vocabulary with its merges is millions of slices."""
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # the view keeps the map open
            return super()._get(offset, dtype, count, override_order)

    return Reader(path)


def convert_gguf(source: Path):
    """A GGUF file's config, its tensors as (shape, produce) to be dequantized one at a time while they are
    written, its special tokens and tokenizer."""
    from gguf.quants import _type_traits, dequantize  # the types it dequantizes: no public list
    try:
        reader = gguf_reader(source)
    except Exception as e:
        with open(source, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            begins = f"it begins {magic!r}; a GGUF file begins b'GGUF'" if magic else "it is empty"
            raise InputError(f"{source}: not a GGUF file ({begins})") from None
        raise InputError(f"{source}: a GGUF file that cannot be read, truncated or damaged ({e}); fetch or copy it "
                         "again") from None
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise InputError(f"{source}: architecture '{arch}' is not supported for GGUF ({', '.join(GGUF_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise InputError(f"{source}: rope frequency tensors (Llama-3.1 GGUF) are not supported; convert the "
                         "Hugging Face directory instead")

    def field(key, default=None):
        value = gguf_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise InputError(f"{source}: missing field '{arch}.{key}'")
        return value

    n_heads = field("attention.head_count")
    n_kv_heads = field("attention.head_count_kv", n_heads)
    tokens = gguf_value(reader, "tokenizer.ggml.tokens") or []
    args = dict(family="llama", vocab_size=field("vocab_size", len(tokens) or None),
                dim=field("embedding_length"), n_layers=field("block_count"), n_heads=n_heads,
                n_kv_heads=n_kv_heads, intermediate_size=field("feed_forward_length"),
                norm_eps=field("attention.layer_norm_rms_epsilon"), rope_theta=field("rope.freq_base", 10000.0),
                qkv_bias="blk.0.attn_q.bias" in names, tie_embeddings="output.weight" not in names,
                max_seq_len=field("context_length"))
    head_dim = args["dim"] // n_heads
    weights = {}
    for t in reader.tensors:
        if t.tensor_type.name not in ("F32", "F16") and t.tensor_type not in _type_traits:
            raise InputError(f"{source}: tensor '{t.name}' is of type {t.tensor_type.name}, which the gguf package "
                             "does not dequantize; convert the Hugging Face directory of this model instead")
        if t.name.startswith("blk."):
            _, i, module, kind = t.name.split(".")
            if module not in GGUF_LAYER_NAMES or kind not in ("weight", "bias"):
                raise InputError(f"{source}: unexpected tensor '{t.name}'")
            ours = f"layers.{i}.{GGUF_LAYER_NAMES[module]}.{kind}"
            # llama.cpp stores a llama's q/k rows interleaved for its rope; qwen2's rope is NeoX's, as ours
            heads = {"attn_q": n_heads, "attn_k": n_kv_heads}.get(module) if arch == "llama" else None
        else:
            ours = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
                    "output.weight": "output.weight"}.get(t.name)
            if ours is None:
                raise InputError(f"{source}: unexpected tensor '{t.name}'")
            heads = None

        def produce(t=t, heads=heads):
            w = dequantize(t.data, t.tensor_type)  # a new array, or for F32 a read-only view of the map
            w = torch.from_numpy(w.copy() if not w.flags.writeable else w)
            return interleaved_to_half(w, heads, head_dim) if heads else w
        weights[ours] = ([int(n) for n in reversed(t.shape)], produce)
    bos, eos = (gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    # llama.cpp adds BOS to SentencePiece and Llama 3 vocabularies unless the file says otherwise
    bos_default = gguf_value(reader, "tokenizer.ggml.model") == "llama" or \
        gguf_value(reader, "tokenizer.ggml.pre") in LLAMA3_NAMES
    special = dict(bos_token_id=bos, eos_token_id=gguf_end_of_generation(reader) or None,
                   add_bos_token=bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", bos_default)))
    template = gguf_value(reader, "tokenizer.chat_template")
    chat = dict(chat_template=template, bos_token=tokens[bos] if bos is not None and bos < len(tokens) else None,
                eos_token=tokens[eos] if eos is not None and eos < len(tokens) else None) if template else None
    return args, weights, special, [gguf_tokenizer(reader, source)], chat


# ---------------------------------------------------------------- writing

def save_checkpoint(output_dir: Path, args: dict, weights: dict, special: dict, tokenizers, chat=None, dtype=None):
    """weights: name -> a tensor, or (shape, produce) for a tensor made as it is written (GGUF's dequantized float32
    ones), so that the converter holds one tensor at a time. Floating tensors are stored in dtype where given.
    chat: the chat template and its BOS and EOS strings, kept as tokenizer_config.json (chat.py reads it)."""
    check_model_args(args, output_dir / "config.json")  # before writing anything
    output_dir.mkdir(parents=True, exist_ok=True)
    names = ["config.json", "model.safetensors"] + [t.name if isinstance(t, Path) else "tokenizer.json"
                                                    for t in tokenizers] + (["tokenizer_config.json"] if chat else [])
    cli.write_mark(output_dir, TOOL, names)  # first: a later run may replace these files, and only these
    config_path = output_dir / "config.json"
    config_path.unlink(missing_ok=True)  # a directory without config.json reads as incomplete until we finish
    entries = {}
    for name, w in weights.items():
        shape, produce, kind = (w.shape, lambda w=w: w, w.dtype) if isinstance(w, torch.Tensor) else (*w, torch.float32)
        entries[name] = (shape, dtype if dtype and kind.is_floating_point else kind, produce)
    write_safetensors(output_dir / "model.safetensors", entries, {"format": "pt"}, progress="writing")
    for tok in tokenizers:
        if isinstance(tok, Path):
            write_atomically(output_dir / tok.name, lambda p: shutil.copyfile(tok, p))
        else:
            write_atomically(output_dir / "tokenizer.json", lambda p: tok.save(str(p)))
    if chat:
        write_atomically(output_dir / "tokenizer_config.json",
                         lambda p: p.write_text(json.dumps(chat, indent=2, ensure_ascii=False) + "\n"))
    config = dict(args, **{k: v for k, v in special.items() if v is not None})
    write_atomically(config_path, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def convert(source, output_dir, dtype=None):
    source, output_dir = Path(source), Path(output_dir)
    if not source.exists():
        raise InputError(f"{source}: not found")
    cli.check_output_dir(output_dir, TOOL, inputs=[source])
    if source.suffix == ".gguf":
        args, weights, special, tokenizers, chat = convert_gguf(source)
    elif source.is_dir():
        args, weights, special, tokenizers, chat = convert_hf(source)
    else:
        raise InputError(f"{source}: expected a Hugging Face model directory or a .gguf file")
    if not tokenizers:
        raise InputError(f"{source}: no tokenizer.json or tokenizer.model found")
    save_checkpoint(output_dir, args, weights, special, tokenizers, chat, dtype)
    return output_dir


def main(argv=None):
    parser = OneLineErrors(description=__doc__)
    parser.add_argument("--source", required=True, help="Hugging Face model directory or .gguf file")
    parser.add_argument("--output_dir", required=True, help="a new or empty directory, or one this tool wrote")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="storage dtype (auto: as the source; dequantized GGUF is float32)")
    opts = parser.parse_args(argv)
    # every file is written under a temporary name, and config.json last
    out = cli.run(convert, opts.source, opts.output_dir, None if opts.dtype == "auto" else getattr(torch, opts.dtype),
                  on_interrupt="interrupted; no file was left half-written")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
