"""The CUDA path, checkable anywhere in minutes: tiny random models built here, synthetic prompts, nothing fetched,
nothing imported beyond torch and this project (the lent GPU machine has PyTorch 2.11 with CUDA 13, no network, no
pytest). Skipped under pytest where CUDA is absent. TEST_CUDA_DEVICE=cpu runs every check on the CPU with model.py
alone (no CPU backend: Inductor compiles model.py, as it does on CUDA), to check the checks where no GPU is at hand.

    python tests/test_cuda.py      # on the GPU machine: every check, one line each, exit status 1 if one fails
    bash scripts/gpu_check_more.sh # that, then 7B-shaped bench rows, into one log (docs/cuda.md)

The checks: a verify's K + 1 rows computed as K + 1 decode steps compute them, bit for bit (what exactness rests
on); greedy speculation == plain greedy (the target's int8 copy as a model drafter, and n-grams; K 4 and 16; each
prompt alone and a ragged batch), all steps compiled (CUDA graphs on CUDA); each mode's compiled forward on the
device in bf16 against the same quantized model's float32 reference on the CPU; the decode step compiled once across
prompt lengths, with no CUDA-graph skip; the sampled law of speculation on the device; an int4 model's memory after
packing (references freed) under 0.6 of bf16's.
"""
import copy
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import quantize  # noqa: E402
from decoding import Steps, generate  # noqa: E402
from loading import apply_backend  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from speculative import logits_to_probs  # noqa: E402
from speculative import ModelDrafter, NgramDrafter, compile_step  # noqa: E402

DEVICE = os.environ.get("TEST_CUDA_DEVICE", "cuda")
ON_CUDA = torch.device(DEVICE).type == "cuda"
# vocabulary, dims and heads that every mode takes (int4: tinygemm's multiples; MX: blocks of 32)
ARGS = ModelArgs(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, intermediate_size=768, max_seq_len=512)
NEW = 40

try:
    import pytest
    pytestmark = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                    reason="CUDA is absent (TEST_CUDA_DEVICE=cpu runs these checks on the CPU)")
    Skip = pytest.skip.Exception
except ImportError:  # `python tests/test_cuda.py` runs the checks itself, pytest or not
    pytest = None

    class Skip(Exception):
        pass


@functools.cache
def reference() -> Transformer:
    """The float32 model on the CPU, random weights (seeded): what every device model is a copy of."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.08, generator=g)
    model.tie_weights()
    return model.eval()


def quantized_reference(mode=None) -> Transformer:
    """The reference, quantized by quantize.py's code (float32 on the CPU): the math a device copy must match."""
    model = copy.deepcopy(reference())
    return quantize.quantize_model(model, mode) if mode else model


def on_device(mode=None) -> Transformer:
    """A bf16 copy on the device, as load_model makes one (floating tensors cast, the device's backend applied on
    CUDA; on the CPU model.py alone)."""
    model = quantized_reference(mode).to(device=DEVICE, dtype=torch.bfloat16)
    if ON_CUDA:
        apply_backend(model)
    return model.eval()


def prompts(lengths=(23, 37)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, ARGS.vocab_size, (n,), generator=g).tolist() for n in lengths]


def logits(model, tokens, input_pos):
    return model(tokens, input_pos)


def test_a_verify_computes_each_row_as_a_decode_step_does():
    """What exact speculation rests on: the target's logits for K + 1 rows in one forward equal K + 1 one-row
    forwards', bit for bit (bf16, compiled as the steps are). The message gives eager's difference too."""
    model, k1 = on_device(), 8
    tokens = torch.tensor(prompts()[:1], device=DEVICE)
    positions = torch.arange(tokens.shape[1], device=DEVICE)[None]
    head, tail = tokens.shape[1] - k1, slice(tokens.shape[1] - k1, None)
    largest = {}
    for name, fn in (("eager", logits), ("compiled", compile_step(logits, DEVICE))):
        model.setup_caches(1, 128)
        with torch.no_grad():
            model(tokens[:, :head], positions[:, :head])
            rows = fn(model, tokens[:, tail], positions[:, tail]).float()
            one_by_one = torch.cat([fn(model, tokens[:, i:i + 1], positions[:, i:i + 1]).float()
                                    for i in range(head, tokens.shape[1])], 1)
        largest[name] = (rows - one_by_one).abs().max().item()
    assert largest["compiled"] == 0, f"largest difference of a logit: {largest}"


def test_the_rows_check_finds_the_first_verify_that_differs():
    """gpu.exact_verify_tokens, which the CUDA backend runs before it serves (its report carries the result): a
    product that computes its rows differently past 8 of them, then an attention past 3 query tokens, are found and
    named, and the longest exact verify is reported (at most what the unpatched model gets on this device). The
    message gives the longest exact verify of each mode here."""
    import gpu
    from backend import LONGEST_VERIFY, report
    found = {mode: gpu.exact_verify_tokens(on_device(mode)) for mode in (None, "int8", "int4", "mxfp6")}
    model = on_device()
    rows, _ = found[None]
    if ON_CUDA:
        assert report(model).max_verify_tokens == rows == LONGEST_VERIFY, found

    class PastEightRows(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * (1 + 2 ** -6 if x.shape[-2] > 8 else 1)
    w2 = model.layers[0].feed_forward.w2
    model.layers[0].feed_forward.w2 = PastEightRows(w2.in_features, w2.out_features, bias=False, device=DEVICE)
    model.layers[0].feed_forward.w2.weight = w2.weight
    patched = gpu.exact_verify_tokens(model)
    assert patched[0] == min(rows, 8) and (rows <= 8 or patched[1].startswith("layers.0.feed_forward.w2 at 9 rows")), \
        (patched, found)
    attention = model.layers[0].attention
    attend, groups = attention.attend, ARGS.n_heads // ARGS.n_kv_heads
    attention.attend = lambda q, *rest: attend(q, *rest) * (1 + 2 ** -6 if q.shape[2] > 3 * groups else 1)
    patched = gpu.exact_verify_tokens(model)
    assert patched[0] == min(rows, 3) and (rows <= 3 or patched[1].startswith("layers.0.attention.attend at 4")), \
        (patched, found)


def test_greedy_speculation_equals_plain_greedy():
    target, steps = on_device(), Steps(compile=True, device=DEVICE)
    plain = [generate(target, [p], NEW, steps)[0][0] for p in prompts()]
    draft = on_device("int8")
    for k in (4, 16):
        for name, drafter in (("int8", ModelDrafter(draft, compile=True)), ("ngram", NgramDrafter())):
            for prompt, expected in zip(prompts(), plain):
                rows, stats = generate(target, [prompt], NEW, steps, drafter=drafter, speculate_k=k)
                assert rows[0] == expected, (name, k)
            rows, _ = generate(target, prompts(), NEW, steps, drafter=drafter, speculate_k=k)
            assert rows == plain, (name, k, "batch")
            if name == "int8":
                assert stats["alpha"] > 0.5, stats  # its own int8 copy: most drafts accepted


def test_the_triton_rows_kernels_serve_every_mode_exactly():
    """gpu.py serves every product and attention on gpu_kernels.py's rows kernels where Triton imports (each checked
    against its reference first), and every row of a 17-row verify is that row alone, bit for bit, in every mode:
    exact by construction, not by the GPU's luck."""
    if not ON_CUDA:
        raise Skip("the Triton kernels run on CUDA (tests/gpu_kernels_checks.py runs them in Triton's interpreter)")
    from backend import LONGEST_VERIFY, report
    served = {}
    for mode in (None, "int8", "int4", "int4k", "mxfp6", "mxfp4"):
        r = report(on_device(mode))
        served[mode or "bf16"] = (r.serves, r.max_verify_tokens, r.fallback)
    assert all(s.startswith("Triton rows kernels") and "attention" in s and rows == LONGEST_VERIFY and not fallback
               for s, rows, fallback in served.values()), served


def test_greedy_speculation_is_exact_in_every_mode():
    """Each quantized target (its own model) speculates its own plain greedy tokens at K = 7 (n-gram drafts: the
    verify's rows are what is checked, not a draft; the rows check covers 1 to 17 rows of each product)."""
    steps = Steps(compile=True, device=DEVICE)
    prompt = prompts()[0]
    for mode in ("int8", "int4", "int4k", "mxfp6"):
        torch.compiler.reset()
        target = on_device(mode)
        plain = generate(target, [prompt], NEW, steps)[0][0]
        rows, _ = generate(target, [prompt], NEW, steps, drafter=NgramDrafter(), speculate_k=7)
        assert rows[0] == plain, mode


def test_each_mode_compiled_matches_the_float_reference():
    """Logits of a 16-token prefill and one decode token, compiled on the device in bf16, against the same quantized
    model in float32 on the CPU: relative RMS below 3% (bf16 rounding: 1.6-1.9% eager on the CPU), 6% for int4(k), whose
    activations are rounded to 8 bits from bf16 inputs on one side and float32 on the other (4.5% eager)."""
    tokens = torch.tensor([prompts((17,))[0]])
    for mode in (None, "int8", "int4", "int4k", "mxfp6", "mxfp4"):
        torch.compiler.reset()  # a fresh compile per mode: five models' graphs would pass Dynamo's recompile limit
        logits = []
        for model, device in ((on_device(mode), DEVICE), (quantized_reference(mode), "cpu")):
            model.setup_caches(1, 32)
            forward = torch.compile(model, fullgraph=True) if device == DEVICE else model
            with torch.no_grad():
                first = forward(tokens[:, :16].to(device), torch.arange(16, device=device)[None])
                last = forward(tokens[:, 16:].to(device), torch.tensor([[16]], device=device))
            logits.append(torch.cat([first, last], 1).float().cpu())
        error = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
        assert error < (0.06 if mode in ("int4", "int4k") else 0.03), (mode, error)


def test_compiled_decode_compiles_once():
    """Three prompt lengths in one cache size: one compile of each step, and (CUDA) no step left out of CUDA graphs."""
    from torch._dynamo.utils import counters
    model, steps = on_device(), Steps(compile=True, device=DEVICE)
    generate(model, prompts((5,)), 8, steps)  # the compile; every later prompt fits the same cache
    skips = counters["inductor"]["cudagraph_skips"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in prompts((17, 40)):
            generate(model, [prompt], 8, steps)
    assert counters["inductor"]["cudagraph_skips"] == skips == 0, dict(counters["inductor"])


def sampled_total_variation(device, vocabulary=None, k=3) -> tuple[float, float]:
    """-> total-variation distance from the exact joint law of two tokens, of plain sampling and of speculative
    sampling (on device). A tiny target (vocabulary 8) and an unrelated draft, temperature 1, top-k 6, K drafts a
    round (or "auto"); vocabulary: the token ids the draft proposes among (its LM head trimmed to them: q is zero
    outside them)."""
    V, temperature, top_k = 8, 1.0, 6
    torch.manual_seed(0)
    target = Transformer(ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   intermediate_size=64, max_seq_len=512)).eval()
    draft = Transformer(ModelArgs(vocab_size=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                  intermediate_size=64, max_seq_len=512)).eval()
    for m in (target, draft):
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.5)
    if vocabulary is not None:
        quantize.keep_outputs(draft.output, vocabulary)
    target, draft = target.to(device), draft.to(device)
    prompt = [1, 5, 2]
    with torch.no_grad():
        target.setup_caches(1, 8)
        first = logits_to_probs(target(torch.tensor([prompt], device=device), torch.arange(3, device=device)[None])[0, -1],
                                temperature, top_k)
        exact = torch.zeros(V, V, device=device)
        for t1 in range(V):
            target.setup_caches(1, 8)
            logits = target(torch.tensor([prompt + [t1]], device=device), torch.arange(4, device=device)[None])[0, -1]
            exact[t1] = first[t1] * logits_to_probs(logits, temperature, top_k)
    exact = exact.cpu()

    def empirical(drafter, seed):
        torch.manual_seed(seed)
        counts = torch.zeros(V, V)
        for _ in range(8):
            # 5 tokens: the first round drafts all of a K of 3 (a round drafts no more than a row can still emit)
            rows, _ = generate(target, [prompt] * 5000, 5, Steps(), temperature=temperature, top_k=top_k,
                               drafter=drafter, speculate_k=k)
            pairs = torch.tensor([r[:2] for r in rows])
            counts += torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).view(V, V).float()
        return counts / counts.sum()

    spec = empirical(ModelDrafter(draft, vocabulary=None if vocabulary is None else vocabulary.to(device)), 1)
    plain = empirical(None, 2)
    return (0.5 * (plain - exact).abs().sum()).item(), (0.5 * (spec - exact).abs().sum()).item()


def test_sampled_speculation_keeps_the_target_distribution():
    plain, spec = sampled_total_variation(DEVICE)
    assert plain < 0.03 and spec < 0.03, (plain, spec)


def test_an_int4_model_holds_under_0_6_of_bf16_after_packing():
    """GPU memory of the bf16 model against its int4 copy once gpu.py has packed it (the references freed)."""
    if not ON_CUDA:
        raise Skip("measures GPU memory")
    sizes = {}
    for mode in (None, "int4"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model = on_device(mode)
        torch.cuda.synchronize()
        sizes[mode] = torch.cuda.memory_allocated() - base
        del model
    assert sizes["int4"] < 0.6 * sizes[None], sizes


if __name__ == "__main__":
    failed = 0
    print(f"# {DEVICE}: {torch.cuda.get_device_name() if ON_CUDA else 'CPU'}, torch {torch.__version__}", flush=True)
    for name, test in [(n, f) for n, f in list(globals().items()) if n.startswith("test_")]:
        start = time.perf_counter()
        try:
            test()
            print(f"ok   {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Skip as e:
            print(f"skip {name}: {e}", flush=True)
        except Exception as e:  # one line each; the run goes on to the next check
            failed += 1
            print(f"FAIL {name} ({time.perf_counter() - start:.1f} s): {type(e).__name__}: {e}"[:2000], flush=True)
    print(f"# {failed} failed" if failed else "# all passed")
    sys.exit(1 if failed else 0)
