"""tokenizer.py on the real SmolLM2 tokenizer rebuilt from GGUF.

Reference: transformers' own GGUF reader supplies vocab and merges (independent of ours). It ignores the GGUF's
pre-tokenizer type, 'smollm', which llama.cpp defines as: isolate every \\p{N} character, then the GPT-2
regex; so the reference gets that pre-split (Digits(individual_digits) + ByteLevel) before comparing.
"""
import copy

from tokenizers import pre_tokenizers

from prompts import humaneval_tasks
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
