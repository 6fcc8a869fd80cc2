"""GGUF tokenizers as llama.cpp applies them: SentencePiece vocabularies (tokenizer.ggml.model "llama") and byte-level
BPE with each pre-tokenizer the converter supports, converted by scripts/convert_checkpoint.py.

The files are GGUFs written here with the `gguf` package from real vocabularies: a SentencePiece model trained here
(byte fallback, a user-defined and a control token), a byte-level BPE trained here (multi-digit and upper-case
contraction tokens, which SmolLM2's and Qwen's vocabularies lack, so that the pre-tokenizers' digit and contraction
rules show), SmolLM2's BPE, and the Qwen pair's. The reference is llama.cpp's own tokenizer (llama-cpp-python,
vocab_only), where it is installed: it builds from source (~10 minutes), so it is not a requirement and those tests
say they skipped. transformers' GGUF tokenizer is the reference that always runs, where it agrees with llama.cpp
(checked with it: byte-level BPE with the gpt-2, llama-bpe and qwen2 pre-tokenizers; SentencePiece where no text
begins after a special token or with a space)."""
import io
import json

import pytest

from cli import humaneval_tasks
from tokenizer import TextStream, Tokenizer

from convert_checkpoint import convert  # noqa: E402
from gguf_import import LLAMA3_SPLIT, PRE_TOKENIZERS, gguf_reader, gguf_tokenizer  # noqa: E402

# Digit runs, contractions in both cases, unicode, whitespace runs, code, special tokens.
TEXTS = ["Hello world", "I'LL pay 1234567 for it, we'Re told; THEY'VE 12 and 9876543210 of them'd", "don't\n'd 's 'S",
         "def f(x):\n    return x  + 12345  # 3.14159\n\n\n", "x1y22z333 0.5e-10 2024-11-26",
         "naïve café — 東京 🚀 ÀÉÎõü Ωμέγα ∑∫ 𝔘𝔫𝔦", "a\tb\u00a0c\u3000d\r\ne", "  leading spaces", "trailing   ", " ",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y",
         "func(a,b)=>{return a+b;} // ~^|<=>$", "\n\n\n\t\t  \n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks()] + \
    ["I'LL pay WE'RE THEY'VE YOU'D IT'S it's 1234567 8901234 555 2024 100000 naïve café"] * 20


def write_vocabulary(path, model, tokens, types, tensors=None, **fields):
    """A GGUF of a tiny llama's hyperparameters and a tokenizer (what llama.cpp loads with vocab_only), and
    `tensors` {name: numpy array} where given."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 256), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 4),
                       ("layer_norm_rms_eps", 1e-5), ("tokenizer_model", model), ("token_list", tokens),
                       ("token_types", types), *fields.items()):
        getattr(w, f"add_{key}")(value)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def trained_sentencepiece(directory):
    """A SentencePiece BPE model trained on HumanEval, with byte fallback, <|im_start|> user-defined and <|im_end|>
    a control token, as a GGUF the way llama.cpp's converter writes one."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(CORPUS).splitlines()), model_writer=model, vocab_size=1200,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, user_defined_symbols=["<|im_start|>"],
        control_symbols=["<|im_end|>"], num_threads=1, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return write_vocabulary(directory / "sentencepiece.gguf", "llama", [p.piece for p in proto.pieces],
                            [p.type for p in proto.pieces], token_scores=[p.score for p in proto.pieces],
                            bos_token_id=1, eos_token_id=2, unk_token_id=0)


def trained_bpe():
    """(tokens, types, merges) of a byte-level BPE trained on HumanEval and digit runs, split as Llama 3 splits."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(tok.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    return tokens, [3 if t in SPECIALS else 1 for t in tokens], merges


def gguf_bpe(reader):
    value = lambda key: reader.fields[key].contents()  # noqa: E731
    return value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type"), value("tokenizer.ggml.merges")


@pytest.fixture(scope="module")
def vocabularies(smollm2, tmp_path_factory):
    """name -> a vocab-only GGUF: the trained SentencePiece model; the trained BPE and SmolLM2's BPE with each
    pre-tokenizer llama.cpp names for them; SmolLM2's own file ('smollm'; Qwen's, 'qwen2': test_real_pair.py)."""
    directory = tmp_path_factory.mktemp("vocabularies")
    files = {"sentencepiece": trained_sentencepiece(directory), "smollm2": smollm2[1]}
    sources = {"trained": trained_bpe(), "smollm2": gguf_bpe(gguf_reader(smollm2[1]))}
    for source, (tokens, types, merges) in sources.items():
        for pre in ("default", "gpt-2", "llama-bpe", "qwen2", "smollm"):
            files[f"{source}-{pre}"] = write_vocabulary(
                directory / f"{source}-{pre}.gguf", "gpt2", tokens, types, token_merges=merges, tokenizer_pre=pre,
                bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"))
    return files


def ours(path):
    return gguf_tokenizer(gguf_reader(path), path)


def texts():
    return TEXTS + [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks()]


def test_converted_tokenizers_give_llama_cpp_s_ids(vocabularies):
    """Every vocabulary and pre-tokenizer, 14 texts and the 164 HumanEval solutions: the ids of llama.cpp's
    tokenize (special tokens parsed, as ours always are)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds from source: "
                                                        "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python)")
    for name, path in vocabularies.items():
        tokenizer = ours(path)
        reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        for text in texts():
            expected = reference.tokenize(text.encode(), add_bos=False, special=True)
            assert tokenizer.encode(text, add_special_tokens=False).ids == expected, (name, text[:60])


def test_converted_tokenizers_give_transformers_ids_where_it_agrees_with_llama_cpp(vocabularies):
    """transformers' own GGUF tokenizer on the same files: the same ids for byte-level BPE with the gpt-2, llama-bpe
    and qwen2 pre-tokenizers, and for SentencePiece on texts where no text follows a special token or begins with
    a space (there llama.cpp adds the SentencePiece space prefix to every text between special tokens, as we do)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    for name, path in vocabularies.items():
        if not name.endswith(("gpt-2", "llama-bpe", "qwen2", "sentencepiece")):
            continue
        tokenizer = ours(path)
        reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for text in texts():
            if name == "sentencepiece" and (text[:1].isspace() or "<|" in text):
                continue
            assert tokenizer.encode(text, add_special_tokens=False).ids == \
                reference.encode(text, add_special_tokens=False), (name, text[:60])


def split(path, text):
    return [piece for piece, _ in ours(path).pre_tokenizer.pre_tokenize_str(text)]


def test_the_pre_tokenizers_split_as_llama_cpp_does(vocabularies):
    """What the rules are (each checked with llama.cpp's own ids above): Llama 3 cuts digit runs in threes and
    matches contractions in either case, Qwen2 and SmolLM take digits one by one, GPT-2 keeps a run whole, with its
    space, and its contractions lower-case; SentencePiece puts its space before every text after a special token."""
    text = "I'LL pay 1234567"
    assert split(vocabularies["trained-llama-bpe"], text) == ["I", "'LL", "Ġpay", "Ġ", "123", "456", "7"]
    assert split(vocabularies["trained-gpt-2"], text) == ["I", "'", "LL", "Ġpay", "Ġ1234567"]
    assert split(vocabularies["trained-qwen2"], text) == ["I", "'LL", "Ġpay", "Ġ", *"1234567"]
    assert split(vocabularies["trained-smollm"], text) == ["I", "'", "LL", "Ġpay", "Ġ", *"1234567"]
    tokens = ours(vocabularies["sentencepiece"]).encode("x<|im_end|>y", add_special_tokens=False).tokens
    assert tokens[-2:] == ["<|im_end|>", "\u2581y"]


def test_a_converted_sentencepiece_checkpoint_adds_bos_and_decodes_to_its_text(vocabularies, tmp_path, capsys):
    """The SentencePiece GGUF converted whole (tiny random weights): tokenizer.json, BOS added as llama.cpp adds it
    to a SentencePiece vocabulary whose file does not say otherwise, byte fallback for characters the vocabulary
    lacks, decoding that gives a text without special tokens back (and streams a generated word's leading space),
    and the chat template carried with its BOS and EOS strings."""
    import numpy as np
    reader = gguf_reader(vocabularies["sentencepiece"])
    tokens, types, scores = (reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type",
                                                                                       "scores"))
    shapes = {"token_embd.weight": (len(tokens), 64), "output_norm.weight": (64,), "output.weight": (len(tokens), 64),
              "blk.0.attn_norm.weight": (64,), "blk.0.ffn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64),
              "blk.0.attn_k.weight": (64, 64), "blk.0.attn_v.weight": (64, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128)}
    rng = np.random.default_rng(0)
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    path = write_vocabulary(tmp_path / "tiny.gguf", "llama", tokens, types, token_scores=scores, bos_token_id=1,
                            eos_token_id=2, unk_token_id=0, chat_template=template,
                            tensors={n: rng.normal(0, 0.1, s).astype(np.float32) for n, s in shapes.items()})
    ckpt = convert(path, tmp_path / "converted")
    tokenizer = Tokenizer(ckpt)
    assert tokenizer.path.name == "tokenizer.json" and tokenizer.add_bos and tokenizer.bos_id == 1
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == 1 and ids[1:] == ours(path).encode(text, add_special_tokens=False).ids
        if "<|" not in text:  # (after a special token the ids hold llama.cpp's inserted space, which decodes)
            assert tokenizer.decode(ids[1:]) == text, text
    assert any(tokens[i].startswith("<0x") for i in tokenizer.encode("🚀"))  # not in the vocabulary: its bytes
    ids = tokenizer.encode("def fibonacci(n): return n")
    assert tokenizer.decode(ids[-2:]) == "return n"  # alone, a first word's space is dropped
    stream = TextStream(tokenizer, ids[:-2])  # after the prompt, generated text keeps it
    stream(ids[-2:-1])
    stream(ids[-1:])
    stream.finish()
    assert capsys.readouterr().out == " return n\n"
    carried = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert carried == {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}


def test_an_unsupported_pre_tokenizer_or_tokenizer_is_one_line(vocabularies, tmp_path):
    from checkpoint import InputError
    tokens, types, merges = gguf_bpe(gguf_reader(vocabularies["smollm2-gpt-2"]))
    path = write_vocabulary(tmp_path / "tekken.gguf", "gpt2", tokens, types, token_merges=merges,
                            tokenizer_pre="tekken")
    with pytest.raises(InputError) as e:
        ours(path)
    assert str(e.value) == (f"{path}: pre-tokenizer 'tekken' (tokenizer.ggml.pre) is not supported "
                            f"({', '.join(PRE_TOKENIZERS)}); convert the Hugging Face directory of this model instead")
    path = write_vocabulary(tmp_path / "bert.gguf", "bert", tokens, types)
    with pytest.raises(InputError) as e:
        ours(path)
    assert "embedded tokenizer 'bert' (tokenizer.ggml.model) is not supported" in str(e.value)
    assert "\n" not in str(e.value)
