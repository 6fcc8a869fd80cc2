"""The CUDA path: skipped where CUDA is absent (this project's CI machines have no GPU).

On a GPU: greedy speculation equals plain greedy decoding (bf16, compiled steps with CUDA graphs; SmolLM2's own int8
copy and the n-gram drafter, K 4 and 16, one row and a ragged batch); every quantized mode's forward on the GPU
in bf16 (int4 on tinygemm) matches the same file's reference forward on the CPU in fp32 (relative RMS of the logits
below 3%); the compiled
decode step compiles once across prompt lengths; speculative sampling keeps the target's distribution (the CPU
test's bound); loading a quantized file allocates less GPU memory than the bf16 weights.
TEST_CUDA_DEVICE=cpu runs the same tests on the CPU (to check the tests themselves where no GPU is at hand).
"""
import os

import pytest
import torch

from bench import humaneval_tasks
from generate import Steps, generate, load_model
from speculative import ModelDrafter, NgramDrafter
from tokenizer import Tokenizer

DEVICE = os.environ.get("TEST_CUDA_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="CUDA is absent (set TEST_CUDA_DEVICE=cpu to run these tests on the CPU)")
NEW = 48


@pytest.fixture(scope="module")
def target(smollm2):
    ckpt, _ = smollm2
    tokenizer = Tokenizer(ckpt)
    model = load_model(ckpt, DEVICE, torch.bfloat16)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(2)]
    steps = Steps(compile=True, device=DEVICE)
    plain = [generate(model, [p], NEW, steps)[0][0] for p in prompts]
    return model, prompts, plain, steps


@pytest.mark.parametrize("k", [4, 16])
def test_greedy_speculation_equals_plain_greedy(target, quantized, k):
    model, prompts, plain, steps = target
    drafters = {"int8": ModelDrafter(load_model(quantized["int8"], DEVICE, torch.bfloat16), compile=True),
                "ngram": NgramDrafter()}
    for name, drafter in drafters.items():
        for prompt, expected in zip(prompts, plain):
            rows, _ = generate(model, [prompt], NEW, steps, drafter=drafter, speculate_k=k)
            assert rows[0] == expected, (name, k)
        rows, _ = generate(model, prompts, NEW, steps, drafter=drafter, speculate_k=k)
        assert rows == plain, (name, k, "batch")


@pytest.mark.parametrize("mode", ["int8", "int4", "mxfp6", "mxfp4"])
def test_quantized_forward_matches_the_cpu_reference(smollm2, quantized, mode):
    ckpt, _ = smollm2
    tokens = torch.tensor([Tokenizer(ckpt).encode(humaneval_tasks(1)[0]["prompt"])])
    logits = []
    for device, dtype, backend in ((DEVICE, torch.bfloat16, "auto"), ("cpu", torch.float32, "torch")):
        model = load_model(quantized[mode], device, dtype, backend=backend)
        model.setup_caches(1, tokens.shape[1])
        with torch.no_grad():
            logits.append(model(tokens.to(device), torch.arange(tokens.shape[1], device=device)[None]).float().cpu())
    error = (logits[0] - logits[1]).norm() / logits[1].norm()
    assert error < 0.03, error  # bf16 against fp32: the CPU backend's bf16 steps measure 0.8-1.5%


def test_compiled_decode_compiles_once(smollm2):
    ckpt, _ = smollm2
    model = load_model(ckpt, DEVICE, torch.bfloat16)
    steps = Steps(compile=True, device=DEVICE)
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    generate(model, [prompts[0]], 8, steps)  # the compile; every later prompt fits the same 256-slot cache
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in prompts[1:]:
            generate(model, [prompt], 8, steps)


def test_sampled_speculation_keeps_the_target_distribution():
    from test_speculative import sampled_total_variation
    plain, spec = sampled_total_variation(DEVICE)
    assert plain < 0.03 and spec < 0.03


@pytest.mark.skipif(DEVICE != "cuda", reason="measures GPU memory")
def test_a_quantized_load_holds_less_than_the_bf16_weights(smollm2, quantized):
    ckpt, _ = smollm2
    sizes = {}
    for name, path in (("bf16", ckpt), ("int4", quantized["int4"])):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = load_model(path, DEVICE, torch.bfloat16)
        sizes[name] = torch.cuda.max_memory_allocated() - base
        del model
    # the int4 file (groups of 32) holds 0.523 of bf16's bytes: its bf16 embedding and the scales and zeros
    assert sizes["int4"] < 0.6 * sizes["bf16"], sizes
