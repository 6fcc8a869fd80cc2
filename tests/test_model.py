"""model.py, alone (--backend torch, its ops' references), against transformers (random-weight configs, no download),
and its own cache/position semantics."""
import copy

import pytest
import torch

from checkpoint import read_model_args
from loading import load_model

TOL = 1e-4  # fp32 max abs logit difference allowed against transformers


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama3_rope_scaling", "qwen2_qkv_bias", "qwen3_head_dim",
                                  "mistral_sliding", "gemma3_sliding", "gemma3_multimodal",
                                  "codegen_partial_rotary"])
def test_logits_match_transformers_prefill_and_16_decode_steps(tiny, name, references):
    ckpt, hf = tiny(name)
    model = load_model(ckpt, "cpu", torch.float32, backend="torch")
    model.setup_caches(1, 64)
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (1, 12 + 16))
    with torch.no_grad():
        ref = hf(tokens[:, :12], use_cache=True)
        ours = model(tokens[:, :12], torch.arange(12)[None])
        assert (ours - ref.logits).abs().max().item() < TOL
        past = ref.past_key_values
        for step in range(16):
            pos = 12 + step
            ref = hf(tokens[:, pos:pos + 1], past_key_values=past, use_cache=True)
            past = ref.past_key_values
            ours = model(tokens[:, pos:pos + 1], torch.tensor([[pos]]))
            assert (ours - ref.logits).abs().max().item() < TOL, f"decode step {step}"


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2_qkv_bias", "qwen3_head_dim", "gemma3_sliding"])
def test_bf16_logits_stay_as_close_to_fp32_as_transformers_in_bf16(tiny, name, references):
    """In bf16, model.py and transformers round differently; model.py's logits must be no further from the fp32
    logits than transformers' own bf16 logits are (x1.5, Gemma 3 x2, + 0.005), and within twice that error (+ 0.01)
    of them, at prefill and 16 decode steps (Gemma 3's 1 + w is rounded to bf16 where transformers adds it in
    float32)."""
    ckpt, hf32 = tiny(name)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    model = load_model(ckpt, "cpu", torch.bfloat16, backend="torch")
    model.setup_caches(1, 64)
    torch.manual_seed(3)
    tokens = torch.randint(0, 256, (1, 12 + 16))
    worst = {"ours": 0.0, "transformers": 0.0, "apart": 0.0}
    with torch.no_grad():
        past32 = past16 = None
        for start, end in [(0, 12)] + [(p, p + 1) for p in range(12, 28)]:
            ref32 = hf32(tokens[:, start:end], past_key_values=past32, use_cache=True)
            ref16 = hf16(tokens[:, start:end], past_key_values=past16, use_cache=True)
            past32, past16 = ref32.past_key_values, ref16.past_key_values
            ours = model(tokens[:, start:end], torch.arange(start, end)[None]).float()
            truth, theirs = ref32.logits, ref16.logits.float()
            for key, diff in [("ours", ours - truth), ("transformers", theirs - truth), ("apart", ours - theirs)]:
                worst[key] = max(worst[key], diff.abs().max().item())
    # Gemma 3 norms six times a layer (around both branches, q and k), each output rounded to bf16 before its weight
    # where transformers multiplies in float32: within 2x (an AVX2 Zen 3: 0.122 vs 0.073; 1.5x held on AVX-512)
    ratio = 2.0 if name == "gemma3_sliding" else 1.5
    assert worst["ours"] <= ratio * worst["transformers"] + 0.005, worst  # measured: 0.010 vs 0.011 (the others)
    assert worst["apart"] <= 2 * worst["transformers"] + 0.01, worst  # measured: Gemma 3 0.109 vs 0.100


def test_llama3_scaling_changes_frequencies(tiny):
    """Guards the parity test above: the tiny config must actually exercise the scaled regime."""
    from model import ModelArgs, rope_frequencies
    ckpt, _ = tiny("llama3_rope_scaling")
    args = read_model_args(ckpt / "config.json")
    plain = ModelArgs(**{**args.__dict__, "rope_scaling": None})
    scaled, unscaled = rope_frequencies(args, "cpu"), rope_frequencies(plain, "cpu")
    ratio = unscaled / scaled
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


@pytest.mark.parametrize("name", ["llama_gqa_tied", "codegen_partial_rotary"])
def test_ragged_rows_and_verify_shaped_forward_match_single_row_decode(tiny, name, references):
    """Rows at different positions in one batch, and a K+1-token forward at an arbitrary position, give the
    logits of plain one-token decoding of each row alone."""
    ckpt, _ = tiny(name)
    model = load_model(ckpt, "cpu", torch.float32, backend="torch")
    torch.manual_seed(2)
    seqs = [torch.randint(0, 256, (n,)) for n in (20, 24)]

    def sequential(seq):
        model.setup_caches(1, 64)
        return torch.cat([model(seq[None, i:i + 1], torch.tensor([[i]])) for i in range(len(seq))], 1)[0]

    expected = [sequential(s) for s in seqs]
    with torch.no_grad():
        # A batch of 2: row 0 has 5 prompt tokens, row 1 has 12, right-padded; then both decode the rest.
        model.setup_caches(2, 64)
        lengths = [5, 12]
        prompt = torch.zeros(2, 12, dtype=torch.long)
        for b, n in enumerate(lengths):
            prompt[b, :n] = seqs[b][:n]
        logits = model(prompt, torch.arange(12).expand(2, 12))
        for b, n in enumerate(lengths):
            torch.testing.assert_close(logits[b, :n], expected[b][:n], rtol=0, atol=1e-5)
        # Verify-shaped: 4 tokens at once at each row's own position.
        pos = torch.stack([torch.arange(n, n + 4) for n in lengths])
        block = torch.stack([seqs[b][n:n + 4] for b, n in enumerate(lengths)])
        logits = model(block, pos)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(logits[b], expected[b][n:n + 4], rtol=0, atol=1e-5)
        # Then one-token decode continues from there; the padded slots were overwritten, never seen.
        for step in range(4):
            pos = torch.tensor([[n + 4 + step] for n in lengths])
            tok = torch.stack([seqs[b][n + 4 + step:n + 5 + step] for b, n in enumerate(lengths)])
            logits = model(tok, pos)
            for b, n in enumerate(lengths):
                torch.testing.assert_close(logits[b, 0], expected[b][n + 4 + step], rtol=0, atol=1e-5)


def test_fp16_runs_on_pytorch_kernels(tiny):
    """The CPU backend has no fp16 products: an fp16 model loaded with --backend auto stays on model.py's PyTorch
    path, and where the float32 model (loaded first) registered the kernels of model.py's ops, they hand fp16 inputs
    back to their references; its decode and verify-shaped steps stay within 0.02 of the fp32 logits."""
    import backend
    ckpt, _ = tiny("llama_gqa_tied")
    logits = {}
    for dtype in (torch.float32, torch.float16):
        model = load_model(ckpt, "cpu", dtype)
        assert backend.report(model).name == ("cpu" if dtype == torch.float32 else "torch")
        model.setup_caches(1, 64)
        tokens = torch.tensor([[5, 17, 42, 7, 99]])
        with torch.no_grad():
            model(tokens[:, :3], torch.arange(3)[None])
            logits[dtype] = torch.cat([model(tokens[:, 3:4], torch.tensor([[3]])),  # decode, 1 row
                                       model(tokens[:, 3:], torch.tensor([[3, 4]]))], 1).float()  # 2 rows
    torch.testing.assert_close(logits[torch.float16], logits[torch.float32], rtol=0, atol=0.02)
