"""speculative.py: the acceptance rule reproduces the target distribution; greedy speculation is lossless."""
import json
import zlib

import pytest
import torch

import backend
from cli import humaneval_tasks
from decoding import Steps, generate
from loading import load_model
from model import ModelArgs, Transformer
from speculative import DraftLength, logits_to_probs
from speculative import ModelDrafter, NgramDrafter, accept, verify
from test_cuda import sampled_total_variation
from test_generate import assert_one_line_error, cli
from tokenizer import Tokenizer

TV_BOUND = 0.01


@pytest.mark.parametrize("temperature,top_k,top_p,same", [
    (1.0, None, None, False), (0.7, None, None, False), (1.0, 3, None, False), (0.7, None, 0.8, False),
    (1.0, None, None, True)])
def test_acceptance_rule_reproduces_the_warped_target(temperature, top_k, top_p, same):
    """200k draws, vocabulary 6, K = 2: the first emitted token's empirical distribution is within TV 0.01 of
    the (warped) target p_1, whatever the draft q was (sampling noise alone gives ~0.002)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((temperature, top_k, top_p, same)).encode()))
    N, K, V = 200_000, 2, 6
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_logits = p_logits[:K] + torch.randn(K, V, generator=g) * 1.5  # related to p, as a real draft is
    if same:
        q_logits = p_logits[:K].clone()
    p = logits_to_probs(p_logits, temperature, top_k, top_p)
    q = logits_to_probs(q_logits, temperature, top_k, top_p)
    draft = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    u = torch.rand(N, K, generator=g)
    noise = torch.empty(N, V).exponential_(1, generator=g)
    n, next_token = accept(draft, q.expand(N, K, V), p.expand(N, K + 1, V), u, noise)
    first = torch.where(n > 0, draft[:, 0], next_token)
    empirical = torch.bincount(first, minlength=V).float() / N
    assert 0.5 * (empirical - p[0]).abs().sum() < TV_BOUND
    if same:
        assert (n == K).all()  # p == q: every draft accepted, no 0/0 in the residual
    # Given the first token was accepted, the second emitted token follows p_2.
    second = torch.where(n > 1, draft[:, 1], next_token)[n > 0]
    assert len(second) > N // 10
    empirical = torch.bincount(second, minlength=V).float() / len(second)
    assert 0.5 * (empirical - p[1]).abs().sum() < 2 * TV_BOUND


def test_greedy_acceptance_and_one_hot_draft():
    p = torch.nn.functional.one_hot(torch.tensor([[3, 1, 4]]), 5).float()
    noise = torch.ones(1, 5)
    n, nxt = accept(torch.tensor([[3, 2]]), None, p, torch.zeros(1, 2), noise)
    assert n.item() == 1 and nxt.item() == 1  # second draft rejected, corrected to the argmax
    n, nxt = accept(torch.tensor([[3, 1]]), None, p, torch.zeros(1, 2), noise)
    assert n.item() == 2 and nxt.item() == 4  # all accepted, bonus token from p_3
    n, _ = accept(torch.tensor([[0, 1]]), None, p, torch.zeros(1, 2), noise)
    assert n.item() == 0  # u = 0 and p = 0: strict < rejects


def test_greedy_verify_equals_the_acceptance_rule_with_one_hots():
    """verify() at temperature 0 skips building one-hots; on random logits (3 rows, K = 4, drafts that partly match
    the argmax) it returns what accept() returns with one-hot p and q: each row's count and next token."""
    torch.manual_seed(3)
    logits = torch.randn(3, 5, 50)
    best = logits.argmax(-1)
    draft = best[:, :4].clone()
    draft[0, 0] = (best[0, 0] + 1) % 50  # row 0: nothing accepted; row 1: 2; row 2: all 4, then the bonus
    draft[1, 2] = (best[1, 2] + 1) % 50
    noise = torch.empty(3, 50).exponential_(1)
    n, nxt = verify(lambda model, tokens, pos: logits, None, None, None, draft, None, torch.zeros(3, 4), noise, 0,
                    None, None)
    p = torch.nn.functional.one_hot(best, 50).float()
    n_ref, nxt_ref = accept(draft, None, p, torch.zeros(3, 4), noise)
    assert n.tolist() == n_ref.tolist() == [0, 2, 4] and torch.equal(nxt, nxt_ref)


def test_ngram_drafter_continues_the_latest_match():
    drafter = NgramDrafter(max_ngram=3)
    history = [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 4, 5, 6, 7]
    tokens, q = drafter.propose([history], torch.tensor([0]), 3, 0.0, None, None)
    assert tokens.tolist() == [[9, 4, 5]] and q is None
    tokens, _ = drafter.propose([[1, 2, 3]], torch.tensor([0]), 2, 0.0, None, None)
    assert tokens.tolist() == [[3, 3]]  # no match: the last token, repeated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_drafts_no_more_than_a_row_can_still_emit(tiny, temperature):
    """Every round asks the drafter for min(K, tokens left - 1) drafts (none when one token is left: the verify then
    sees only padding); greedy output equals plain decoding, sampled output has the requested length."""
    ckpt, _ = tiny("llama_gqa_tied")
    model = load_model(ckpt, "cpu", torch.float32)
    prompt, k = [3, 4, 5, 3, 4, 5, 3, 4], 4
    asked = []

    class Recording(ModelDrafter):
        def propose(self, histories, pos, n, *rest):
            asked.append((len(histories[0]) - len(prompt), n))  # (tokens emitted so far, drafts asked)
            return super().propose(histories, pos, n, *rest)

    for max_new_tokens in (2, 3, 13):
        asked.clear()
        torch.manual_seed(0)
        rows, _ = generate(model, [prompt], max_new_tokens, Steps(), temperature, speculate_k=k,
                           drafter=Recording(load_model(ckpt, "cpu", torch.float32)))
        assert len(rows[0]) == max_new_tokens
        if temperature == 0:
            assert rows[0] == generate(model, [prompt], max_new_tokens, Steps())[0][0]
        assert all(n == min(k, max_new_tokens - emitted - 1) and n > 0 for emitted, n in asked), asked
        assert bool(asked) == (max_new_tokens > 2)


@pytest.fixture(scope="module")
def real(smollm2):
    ckpt, _ = smollm2
    tokenizer = Tokenizer(ckpt)
    model = load_model(ckpt, "cpu", torch.float32)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(3)]
    plain = [generate(model, [p], 64, Steps())[0][0] for p in prompts]
    return ckpt, model, prompts, plain


def random_draft(vocab_size):
    torch.manual_seed(3)
    draft = Transformer(ModelArgs(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  intermediate_size=128, max_seq_len=8192))
    return draft.eval()


@pytest.mark.parametrize("drafter_kind", ["self", "random", "ngram"])
def test_greedy_speculation_equals_plain_decoding_on_smollm2(real, drafter_kind):
    ckpt, model, prompts, plain = real
    k = 4
    if drafter_kind == "self":
        drafter = ModelDrafter(load_model(ckpt, "cpu", torch.float32))
    elif drafter_kind == "random":
        drafter = ModelDrafter(random_draft(model.args.vocab_size))
    else:
        drafter = NgramDrafter()
    for prompt, expected in zip(prompts, plain):
        rows, stats = generate(model, [prompt], 64, Steps(), drafter=drafter, speculate_k=k)
        assert rows[0] == expected
        if drafter_kind == "self":
            assert stats["mean_accepted"] == k + 1 and stats["alpha"] == 1.0
        if drafter_kind == "random":
            assert stats["alpha"] < 0.05
    # (d) the three prompts as one ragged batch: each row accepts its own count and equals its plain output
    rows, stats = generate(model, prompts, 64, Steps(), drafter=drafter, speculate_k=k)
    assert rows == plain


@pytest.mark.parametrize("vocabulary, k", [(None, 3), ([0, 2, 3, 5], 3), ([1, 2, 6, 7], "auto")])
def test_sampled_speculation_matches_the_target_distribution(vocabulary, k):
    """Tiny random target (vocabulary 8) and an unrelated random draft, temperature 1, top-k 6, K = 3 drafts a round
    or auto (rounds of any length); the draft proposing among all 8 tokens or among 4 of them (its LM head trimmed:
    q is zero at the other 4, which the target still emits). Statistic: the total-variation distance between the
    empirical joint distribution of the first two generated tokens over 40k sequences and the exact joint computed
    from the target's own logits. Bound 0.03; sampling noise alone gives about 0.015 (plain sampling is held to the
    same bound as a control)."""
    plain, spec = sampled_total_variation("cpu", None if vocabulary is None else torch.tensor(vocabulary), k)
    assert plain < 0.03
    assert spec < 0.03


def test_cli_speculation_metrics_and_vocabulary_check(tiny, tmp_path):
    ckpt, _ = tiny("llama_gqa_tied")
    result = cli("--checkpoint_path", str(ckpt), "--prompt", "abcabcabcab", "--max_new_tokens", "12", "--json",
                 "--dtype", "fp32", "--temperature", "0", "--draft", "ngram", "--speculate_k", "3")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["speculate_k"] == 3 and len(record["accept_counts"]) == 4
    for key in ("mean_accepted", "alpha", "draft_cost_ratio"):
        assert key in record
    plain = cli("--checkpoint_path", str(ckpt), "--prompt", "abcabcabcab", "--max_new_tokens", "12", "--json",
                "--dtype", "fp32", "--temperature", "0")
    assert json.loads(plain.stdout)["tokens"] == record["tokens"]

    other, _ = tiny("codegen_partial_rotary")  # same vocabulary size, but make its tokenizer differ
    (tmp_path / "draft").mkdir()
    for f in other.iterdir():
        (tmp_path / "draft" / f.name).write_bytes(f.read_bytes())
    tok = json.loads((tmp_path / "draft" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "draft" / "tokenizer.json").write_text(json.dumps(tok))
    result = cli("--checkpoint_path", str(ckpt), "--draft_checkpoint", str(tmp_path / "draft"), "--json")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error:") and "tokenizer differs" in result.stderr


def simulated_text(length=30000, seed=0):
    """A text as a draft meets it: per position the draft's probability of its token, 0.99 in runs of sure text and
    0.3-0.9 in runs of unsure text (a run ends with chance 0.1 a token), and whether the target accepts it (with
    chance p^2, not the draft's p: a calibration must learn that)."""
    import random
    rng, sure, text = random.Random(seed), True, []
    for _ in range(length):
        sure = sure != (rng.random() < 0.1)
        p = 0.99 if sure else rng.uniform(0.3, 0.9)
        text.append((p, rng.random() < p * p))
    return text


def tokens_a_second(text, drafts):
    """A policy's rate over the text, a draft step costing 0.1 and a verify 1 + 0.08 a draft: each round drafts
    drafts(probabilities) tokens, where probabilities(i) is the draft's i-th's, and emits the accepted ones and one
    more."""
    pos = seconds = 0
    while pos < len(text) - 20:
        n = drafts(lambda i: text[pos + i][0])
        accepted = next((i for i in range(n) if not text[pos + i][1]), n)
        pos, seconds = pos + accepted + 1, seconds + 0.1 * n + 1 + 0.08 * n
        yield n, accepted
    return pos / seconds


def rate_of(text, drafts, on_round=lambda n, accepted: None):
    rounds = tokens_a_second(text, drafts)
    try:
        while True:
            on_round(*next(rounds))
    except StopIteration as done:
        return done.value


def as_drafted_by(length):
    """A policy for tokens_a_second: a round drafts while DraftLength says one more is worth it."""
    def drafts(probability):
        length.set_threshold(length.start([True], 16))
        n = 1
        while length.more(torch.tensor([probability(n - 1)])):
            n += 1
        return n
    return drafts


def test_draft_length_beats_every_fixed_k_and_learns_the_drafts_worth():
    """speculative.DraftLength (--speculate_k auto) on a simulated text (simulated_text): the rate it reaches is at
    least 1.1x that of the best fixed K (1-16) on the same text, and its calibration learns that a draft of
    probability 0.99 is accepted with chance ~0.98 and one of ~0.5 with ~0.25 (the prior said 0.99 and 0.5)."""
    text = simulated_text()
    best = max(rate_of(text, lambda probability, k=k: k) for k in range(1, 17))
    length = DraftLength(k_max=16)
    rate = rate_of(text, as_drafted_by(length),
                   lambda n, accepted: length.update([accepted], [True], 0.1 * n, 1 + 0.08 * n))
    assert rate >= 1.1 * best, (rate, best)
    assert abs(length.chance(0.99, 0) - 0.98) < 0.03 and abs(length.chance(0.5, 0) - 0.25) < 0.1


def test_draft_length_forgets_a_verify_timed_once_far_off_its_cost():
    """Each verify length's first reading told to DraftLength at 50x its cost (as if each compiled inside the decode):
    over the simulated text the rate is at least 0.97x that of a learner told only true costs. (Without forgetting a
    length not verified for DraftLength.FORGET rounds, the long ones' first readings held every later round at one
    draft: 0.77x.)"""
    text = simulated_text()

    def rate(first_reading):
        length, timed = DraftLength(k_max=16), set()

        def on_round(n, accepted):
            slow = 1 if n in timed else first_reading
            timed.add(n)
            length.update([accepted], [True], 0.1 * n, (1 + 0.08 * n) * slow)
        return rate_of(text, as_drafted_by(length), on_round)
    assert rate(first_reading=50) >= 0.97 * rate(first_reading=1)


@pytest.fixture(scope="module")
def real_bf16(smollm2):
    ckpt, _ = smollm2
    tokenizer = Tokenizer(ckpt)
    model = load_model(ckpt, "cpu", torch.bfloat16)
    prompts = [tokenizer.encode("def f(x):"), tokenizer.encode(humaneval_tasks(1)[0]["prompt"])]
    plain = [generate(model, [p], 48, Steps())[0][0] for p in prompts]
    # A ragged batch prefills its short row in PyTorch's GEMM (its longest prompt is over 33 tokens), which rounds
    # otherwise than the few-row kernels that prefill it alone: its plain output is the batch's own reference.
    plain_batch = generate(model, prompts, 48, Steps())[0]
    return model, prompts, plain, plain_batch


@pytest.mark.parametrize("k", [7, 15, 16])
def test_greedy_speculation_is_exact_at_any_k_in_bf16(real_bf16, quantized, k):
    """A verify computes each of its K + 1 rows as a decode step does, however many rows it has: bf16 output equals
    plain greedy output token for token with a model drafter (SmolLM2's own int8 copy: most drafts accepted), the
    n-gram drafter (most rejected), and a ragged batch of two rows (against the batch's plain output), up to the
    longest verify (K = 16, backend.LONGEST_VERIFY). (Verifies of 17 rows once left the few-row kernels for PyTorch's
    GEMM, whose sums round differently: K = 16 gave another second line.)"""
    model, prompts, plain, plain_batch = real_bf16
    drafters = {"int8": ModelDrafter(load_model(quantized["int8"], "cpu", torch.bfloat16)), "ngram": NgramDrafter()}
    for name, drafter in drafters.items():
        for prompt, expected in zip(prompts, plain):
            rows, stats = generate(model, [prompt], 48, Steps(), drafter=drafter, speculate_k=k)
            assert rows[0] == expected, (name, k)
        rows, _ = generate(model, prompts, 48, Steps(), drafter=drafter, speculate_k=k)
        assert rows == plain_batch, (name, k, "batch")


def draft_beside(ckpt, directory):
    """A checkpoint directory of links to the real one's files: a draft whose directory the test may write in."""
    for path in ckpt.iterdir():
        if path.name in ("config.json", "model.safetensors") or path.name.startswith("tokenizer"):
            (directory / path.name).symlink_to(path)
    return directory


def test_a_full_precision_draft_runs_as_int4_written_once_and_gives_the_same_tokens(real_bf16, smollm2, tmp_path):
    """--draft_quantize auto (the default): a bf16 draft runs as quantize.py's int4 copy, written beside it once with
    the loader's mark and mapped by later loads; greedy output equals the bf16 draft's run and plain decoding."""
    import quantize
    from loading import make_drafter
    model, prompts, plain, _ = real_bf16
    directory = draft_beside(smollm2[0], tmp_path)
    copy = directory / "model.int4.safetensors"
    said = []
    drafter = make_drafter("model", directory, say=said.append, vocab=None)
    assert drafter.form == f"int4 ({copy})" and len(said) == 1 and f"writing its int4 copy {copy}" in said[0]
    assert map_metadata(copy)["written_for"] == "draft" and quantize.current_copy(copy, directory / "model.safetensors",
                                                                                  "int4")
    written = copy.stat().st_mtime_ns
    again = make_drafter("model", directory, say=said.append, vocab=None)
    assert again.form == drafter.form and copy.stat().st_mtime_ns == written and len(said) == 1  # reused
    as_is = make_drafter("model", directory, form="none", vocab=None)
    assert as_is.form == "bf16"
    for prompt, expected in zip(prompts, plain):
        for d in (drafter, as_is):
            rows, stats = generate(model, [prompt], 48, Steps(), drafter=d, speculate_k=7)
            assert rows[0] == expected
    assert make_drafter("model", directory, backend="torch", vocab=None).form == "bf16"  # (int4 dequantizes each call)


def test_a_draft_proposes_among_its_likeliest_tokens_ranked_once_and_gives_the_same_tokens(real_bf16, smollm2,
                                                                                          tmp_path):
    """--draft_vocab N (the default 32768): the draft's LM head keeps the rows of its N likeliest tokens, ranked by
    their counts over the standard library's source once and written beside it (draft_vocab.safetensors, with the
    loader's mark and the tokenizer's hash), read by later loads; the end-of-generation tokens are among them. Greedy
    output equals plain decoding however few tokens the draft proposes among (4096 of 49152 here), compiled or not,
    at a fixed K and at auto. A file of that name the loader did not write is never replaced (the ranking is then
    made in memory, said in one line)."""
    from loading import VOCAB_FILE, draft_vocabulary, make_drafter
    model, prompts, plain, _ = real_bf16
    directory = draft_beside(smollm2[0], tmp_path)
    said = []
    ids = draft_vocabulary(directory, 4096, say=said.append)
    ranking = directory / VOCAB_FILE
    assert len(said) == 1 and str(ranking) in said[0] and "standard library" in said[0]
    assert ids.shape == (4096,) and bool((ids[1:] > ids[:-1]).all())
    tokenizer = Tokenizer(directory)
    assert set(tokenizer.eos_ids) <= set(ids.tolist()) and " def" in [tokenizer.decode([i]) for i in ids.tolist()]
    written = ranking.stat().st_mtime_ns
    assert torch.equal(draft_vocabulary(directory, 4096, say=said.append), ids) and len(said) == 1
    assert ranking.stat().st_mtime_ns == written  # read, not written again
    assert draft_vocabulary(directory, 49152) is None  # all of it: the head as it is
    for compiled, runs in ((False, [(4, 0), (4, 1), ("auto", 0), ("auto", 1)]), (True, [("auto", 1)])):
        drafter = make_drafter("model", directory, compile=compiled, vocab=4096, form="int8")
        assert drafter.form.endswith("proposing among 4096 of 49152 tokens")
        assert drafter.model.output.out_features == 4096
        for k, i in runs:
            rows, stats = generate(model, [prompts[i]], 48, Steps(compile=compiled), drafter=drafter, speculate_k=k)
            assert rows[0] == plain[i], (compiled, k, i)
            assert stats["alpha"] > 0.3, stats
    ranking.write_bytes(b"my notes")
    said.clear()
    assert torch.equal(draft_vocabulary(directory, 4096, say=said.append), ids)
    assert ranking.read_bytes() == b"my notes" and len(said) == 1 and "in memory" in said[0]


def map_metadata(path):
    from checkpoint import map_safetensors
    return map_safetensors(path)[1]


def test_the_draft_copy_never_replaces_a_users_file(smollm2, tmp_path):
    """A file of the copy's name that the loader did not write stays as it is, even stale: the draft is then
    quantized in memory. Only a stale copy with the loader's own mark is written again."""
    import os
    import quantize
    from loading import load_draft
    directory = draft_beside(smollm2[0], tmp_path)
    copy = directory / "model.int4.safetensors"
    copy.write_bytes(b"my notes")
    model, form = load_draft(directory, say=lambda line: None)
    assert form == "int4 (in memory)" and copy.read_bytes() == b"my notes"
    assert getattr(model.layers[0].attention.wo, "mode", None) == "int4"  # quantized (served by the backend)
    copy.unlink()
    quantize.quantize_checkpoint(directory, "int4", groupsize=64, progress=False)  # the user's own, current: used
    assert load_draft(directory, say=lambda line: None)[1] == f"int4 ({copy})"
    source = (directory / "model.safetensors").stat().st_mtime
    os.utime(copy, (source - 60, source - 60))  # now older than its source: stale, and not the loader's
    mine = copy.read_bytes()
    assert load_draft(directory, say=lambda line: None)[1] == "int4 (in memory)" and copy.read_bytes() == mine
    copy.unlink()
    load_draft(directory, say=lambda line: None)
    os.utime(copy, (source - 60, source - 60))  # the loader's own stale copy: replaced
    said = []
    assert load_draft(directory, say=said.append)[1] == f"int4 ({copy})" and "writing" in said[0]
    assert copy.stat().st_mtime >= source


def test_draft_quantize_flag(tiny, tmp_path):
    """The form a draft ran in is in --json; a draft int4 does not fit (its groups, its 16s) runs as it is under auto, and asked
    for int4 it is one line; the flag without a draft model, or of an unknown form, is one line; so are --draft_vocab's
    (the form says how many tokens the draft proposes among)."""
    from loading import quantize_fits
    ckpt, _ = tiny("llama_gqa_tied")
    draft = draft_beside(ckpt, tmp_path)
    args = ["--checkpoint_path", ckpt, "--draft_checkpoint", draft, "--prompt", "ab", "--max_new_tokens", "4",
            "--temperature", "0", "--json", "--dtype", "fp32"]
    record = json.loads(cli(*args).stdout)
    assert record["draft_form"] == f"int4 ({draft / 'model.int4.safetensors'})"
    assert json.loads(cli(*args, "--draft_quantize", "none").stdout)["draft_form"] == "fp32"
    assert_one_line_error(cli("--checkpoint_path", ckpt, "--draft_quantize", "int4", "--prompt", "ab"),
                          "--draft_quantize applies to a draft model")
    assert_one_line_error(cli(*args, "--draft_quantize", "int3"), "--draft_quantize int3: unknown")
    among = json.loads(cli(*args, "--draft_vocab", "64").stdout)  # (the tiny model's 256 tokens, ranked once)
    assert among["draft_form"].endswith("proposing among 64 of 256 tokens"), among["draft_form"]
    assert_one_line_error(cli(*args, "--draft_vocab", "100"), "--draft_vocab: '100' is not 'all' or a multiple of 16")
    assert_one_line_error(cli("--checkpoint_path", ckpt, "--draft_vocab", "64", "--prompt", "ab"),
                          "--draft_vocab applies to a draft model")
    copy = draft / "model.int4.safetensors"
    assert_one_line_error(cli(*args[:3], copy, *args[4:], "--draft_quantize", "int8"), "is already int4")
    small = ModelArgs(vocab_size=250, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=96,
                      max_seq_len=64)  # a head of 250 outputs: not whole 16s, as int4 needs them
    assert not quantize_fits(small, "int4") and quantize_fits(small, "int8")


def test_the_cuda_backends_rows_check_on_the_cpu(monkeypatch):
    """tests/test_cuda.py's check of gpu.exact_verify_tokens (what the CUDA backend runs before it serves, and what
    its report carries), here on the CPU with model.py alone: a product and an attention made to compute rows
    differently past 8 and 3 rows are found and named (unpatched, model.py's bf16 computes every row alike here)."""
    import gpu
    import test_cuda
    monkeypatch.setattr(test_cuda, "DEVICE", "cpu")
    monkeypatch.setattr(test_cuda, "ON_CUDA", False)
    assert gpu.exact_verify_tokens(test_cuda.on_device()) == (backend.LONGEST_VERIFY, "")
    test_cuda.test_the_rows_check_finds_the_first_verify_that_differs()
