"""Importing a GGUF file (llama, qwen2, qwen3, gemma3 architectures): its metadata as ModelArgs fields, its tensors dequantized one
at a time as they are written (llama's q/k rows reordered to our rotary halves), its special tokens and chat
template, and the tokenizer llama.cpp builds from its vocabulary, as a `tokenizers` Tokenizer.
scripts/convert_checkpoint.py writes what `read_gguf` returns.
"""
from pathlib import Path

import torch

from checkpoint import InputError
from hf_import import interleaved_to_half

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
GGUF_LAYER_NAMES = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm", "post_attention_norm": "post_attention_norm", "post_ffw_norm": "post_ffn_norm",
}


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


def read_gguf(source: Path):
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
                max_seq_len=field("context_length"), qk_norm="blk.0.attn_q_norm.weight" in names)
    head_dim = args["head_dim"] = gguf_value(reader, f"{arch}.attention.key_length", args["dim"] // n_heads)
    if arch == "gemma3":  # what llama.cpp fixes for Gemma 3 and its files leave out (its norms hold 1 + w already)
        n_layers = args["n_layers"]
        args.update(family="gemma3", sliding_window=field("attention.sliding_window"), rope_local_theta=10000.0,
                    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
                    # the 27B (62 layers) scales scores by dim / heads, the others by head_dim
                    query_pre_attn_scalar=args["dim"] // n_heads if n_layers == 62 else head_dim)
        if gguf_value(reader, f"{arch}.rope.scaling.type") == "linear":
            args["rope_scaling"] = dict(rope_type="linear", factor=field("rope.scaling.factor"))
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
