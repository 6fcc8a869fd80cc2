"""model.py, alone (--backend torch), against transformers (random-weight configs, no download), and its own
cache/position semantics."""
import pytest
import torch

from checkpoint import read_model_args
from loading import load_model

TOL = 1e-4  # fp32 max abs logit difference allowed against transformers


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama3_rope_scaling", "codegen_partial_rotary"])
def test_logits_match_transformers_prefill_and_16_decode_steps(tiny, name):
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
def test_ragged_rows_and_verify_shaped_forward_match_single_row_decode(tiny, name):
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
    path (once the C++ dtype check raised in its steps), and its decode and verify-shaped steps stay within 0.02
    of the fp32 logits."""
    import cpu
    ckpt, _ = tiny("llama_gqa_tied")
    logits = {}
    for dtype in (torch.float16, torch.float32):
        model = load_model(ckpt, "cpu", dtype)
        served = any(type(m).__module__ == cpu.modules.__name__ for m in model.modules())
        assert served == (dtype == torch.float32)
        model.setup_caches(1, 64)
        tokens = torch.tensor([[5, 17, 42, 7, 99]])
        with torch.no_grad():
            model(tokens[:, :3], torch.arange(3)[None])
            logits[dtype] = torch.cat([model(tokens[:, 3:4], torch.tensor([[3]])),  # decode, 1 row
                                       model(tokens[:, 3:], torch.tensor([[3, 4]]))], 1).float()  # 2 rows
    torch.testing.assert_close(logits[torch.float16], logits[torch.float32], rtol=0, atol=0.02)
