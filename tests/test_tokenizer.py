"""tokenizer.py on the real SmolLM2 tokenizer rebuilt from GGUF.

Reference: transformers' own GGUF reader supplies vocab and merges (independent of ours). It ignores the GGUF's
pre-tokenizer type, 'smollm', which llama.cpp defines as: isolate every \\p{N} character, then the GPT-2
regex; so the reference gets that pre-split (Digits(individual_digits) + ByteLevel) before comparing.
"""
import copy

from tokenizers import pre_tokenizers

from cli import humaneval_tasks
from tokenizer import Tokenizer


def test_encodings_match_reference_on_all_humaneval_tasks(smollm2, hf_smollm2):
    ckpt, _ = smollm2
    _, hf_tok = hf_smollm2
    reference = copy.deepcopy(hf_tok.backend_tokenizer)
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    ours = Tokenizer(ckpt)
    texts = [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks()]
    texts += ["<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n", "naïve café — 東京 🚀"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text).ids, text[:60]
        assert ours.decode(ids) == text
    assert ours.eos_ids == {0, 2} and ours.vocab_size == 49152  # <|endoftext|> and <|im_end|>: llama.cpp's EOG


def test_smollm_pre_split_isolates_digits(smollm2):
    ours = Tokenizer(smollm2[0])
    pieces = [ours.decode([i]) for i in ours.encode("x = [\n    12]")]
    assert pieces[-4:] == ["\n    ", "1", "2", "]"]
    assert ours.encode("<|im_start|>") == [1]  # control tokens are never split


def test_a_sentencepiece_checkpoint_encodes_decodes_and_generates(tiny, tmp_path):
    """The tokenizer.model path (Llama 2-style checkpoints): ids as sentencepiece gives them with BOS first, control
    tokens special, the first word's space kept after a context, and generate.py's text the decoding of its tokens."""
    import io
    import json
    import os

    import sentencepiece as spm

    from test_generate import cli
    texts = [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks(40)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=200,
                                   model_type="bpe", character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    ckpt, _ = tiny("llama_gqa_tied")  # vocabulary 256: room for the 200 pieces
    for name in ("config.json", "model.safetensors"):
        os.symlink(ckpt / name, tmp_path / name)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ours = Tokenizer(tmp_path)
    assert ours.vocab_size == 200 and ours.special_ids == {1, 2} and ours.eos_ids == {2}
    for text in texts[:5]:
        assert ours.encode(text) == [1] + reference.EncodeAsIds(text)
        assert ours.encode(text, bos=False) == reference.EncodeAsIds(text)
        assert ours.decode(ours.encode(text)) == text
    context, more = ours.encode("def f"), ours.encode("return x", bos=False)
    assert ours.decode(more) == "return x" and ours.decode_after(context, more) == " return x"
    done = cli("--checkpoint_path", tmp_path, "--prompt", "def add(a, b):", "--max_new_tokens", "12",
               "--temperature", "0", "--dtype", "fp32", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["prompt_tokens"] == len(ours.encode("def add(a, b):"))
    assert record["text"] == ours.decode_after(ours.encode("def add(a, b):"), [t for t in record["tokens"] if t != 2])
