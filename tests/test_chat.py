"""generate.py --chat: messages formatted by the checkpoint's own chat template (against transformers'
apply_chat_template on the same GGUF), replies that end at the template's end-of-turn token, later turns that
prefill only what the cache lacks, speculative chat that is plain chat token for token, one-line errors."""
import io
import json

import pytest
import torch

import decoding
import generate
from chat import Chat, ChatTemplate
from test_cli import one_line_error, the_work_is_never_reached
from test_generate import cli
from tokenizer import Tokenizer

import fetch_models  # noqa: E402 (tests/conftest.py puts scripts/ on the path)

MESSAGES = ["What is the capital of France? Answer in one short sentence.", "And of Germany?"]


@pytest.fixture
def prefills(monkeypatch):
    """Every prefill the CLI runs: (first position, last position + 1, the tokens fed), batch row 0."""
    seen, plain = [], decoding.prefill

    def recorded(model, tokens, input_pos, *args):
        seen.append((int(input_pos[0, 0]), int(input_pos[0, -1]) + 1, tokens[0].tolist()))
        return plain(model, tokens, input_pos, *args)
    monkeypatch.setattr(decoding, "prefill", recorded)
    return seen


def chat(monkeypatch, ckpt, *flags, turns=MESSAGES):
    """generate.py --chat --json in this process, the turns on stdin: (its JSON records, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{t}\n\n" for t in turns)))  # blank lines are skipped
    result = cli("--checkpoint_path", ckpt, "--chat", "--json", "--temperature", "0", "--max_new_tokens", "48", *flags)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr


def reference_ids(gguf, messages):
    from transformers import AutoTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return list(reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def check_two_turns(monkeypatch, prefills, ckpt, gguf, *flags):
    """Two turns: the first prompt is transformers' apply_chat_template of the message, the reply ends at its
    end-of-turn token; the second turn prefills only what the cache lacks, the first reply's end-of-turn token
    (sampled, never fed) and the new turn, whose tokens are the last of transformers' rendering of the whole
    conversation. Returns the records."""
    records, err = chat(monkeypatch, ckpt, *flags)
    assert [r["turn"] for r in records] == [0, 1], err
    first_ids = reference_ids(gguf, [{"role": "user", "content": MESSAGES[0]}])
    turns = prefills[-2:]
    assert turns[0] == (0, len(first_ids), first_ids)
    reply = records[0]["tokens"]
    assert reply[-1] in Chat(ChatTemplate(ckpt), Tokenizer(ckpt)).stop_ids
    start = len(first_ids) + len(reply) - 1
    assert turns[1][:2] == (start, records[1]["prompt_tokens"])
    assert records[1]["prefilled_tokens"] == records[1]["prompt_tokens"] - start == len(turns[1][2])
    assert turns[1][2][0] == reply[-1]
    conversation = [{"role": "user", "content": MESSAGES[0]}, {"role": "assistant", "content": records[0]["text"]},
                    {"role": "user", "content": MESSAGES[1]}]
    whole, new = reference_ids(gguf, conversation), turns[1][2][1:]
    assert whole[:len(first_ids)] == first_ids and whole[-len(new):] == new
    return records


def test_smollm2_chat_is_its_template_turn_by_turn(smollm2, monkeypatch, prefills):
    ckpt, gguf = smollm2
    check_two_turns(monkeypatch, prefills, ckpt, gguf)


def test_a_later_turn_gives_what_the_whole_conversation_prefilled_gives(smollm2, monkeypatch, prefills):
    """The second turn's reply from the kept cache == the reply to the same tokens prefilled from scratch (float32,
    where one prefill and two give the same bits to greedy decoding)."""
    from loading import load_model
    ckpt, _ = smollm2
    records, _ = chat(monkeypatch, ckpt, "--dtype", "fp32")
    tokens = prefills[0][2] + records[0]["tokens"] + prefills[-1][2][1:]
    assert len(tokens) == records[1]["prompt_tokens"]
    model = load_model(ckpt, "cpu", torch.float32)
    stop = Chat(ChatTemplate(ckpt), Tokenizer(ckpt)).stop_ids
    rows, stats = decoding.generate(model, [tokens], 48, decoding.Steps(), eos_ids=stop)
    assert stats["prefilled"] == (0, len(tokens)) and rows[0] == records[1]["tokens"]


def test_smollm2_speculative_chat_is_plain_chat(smollm2, quantized, monkeypatch):
    """Greedy, two turns: drafted by its int8 copy (a model drafter's cache is kept across turns too) and by
    n-grams, the replies are the plain replies token for token."""
    ckpt, _ = smollm2
    plain, _ = chat(monkeypatch, ckpt)
    for flags in (["--draft_checkpoint", quantized["int8"], "--speculate_k", "4"],
                  ["--draft", "ngram", "--speculate_k", "3"], ["--draft_checkpoint", quantized["int8"], "--compile"]):
        drafted, _ = chat(monkeypatch, ckpt, *flags)
        assert [r["tokens"] for r in drafted] == [r["tokens"] for r in plain], flags
        assert all("alpha" in r for r in drafted)


def test_the_qwen_pair_chats_as_transformers_renders_and_speculates_exactly(monkeypatch, prefills):
    """Qwen2.5-Coder 1.5B: its template as transformers applies it, two turns, the cache kept; drafted by the 0.5B,
    the replies are the plain ones."""
    target, draft = (fetch_models.fetch(name) for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    gguf = fetch_models.CHECKPOINTS / fetch_models.MODELS["qwen2.5-coder-1.5b"].file
    plain = check_two_turns(monkeypatch, prefills, target, gguf)
    drafted, _ = chat(monkeypatch, target, "--draft_checkpoint", draft, "--speculate_k", "4")
    assert [r["tokens"] for r in drafted] == [r["tokens"] for r in plain]


def test_chat_streams_replies_and_ends_each_with_a_newline(smollm2, monkeypatch):
    ckpt, _ = smollm2
    records, _ = chat(monkeypatch, ckpt)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(MESSAGES) + "\n"))
    streamed = cli("--checkpoint_path", ckpt, "--chat", "--temperature", "0", "--max_new_tokens", "48")
    assert streamed.returncode == 0 and streamed.stdout == "".join(r["text"] + "\n" for r in records)
    one = cli("--checkpoint_path", ckpt, "--chat", "--temperature", "0", "--max_new_tokens", "48", "--prompt",
              MESSAGES[0])
    assert one.stdout == records[0]["text"] + "\n"


def test_chat_errors_are_one_line_before_any_model_loads(smollm2, tmp_path, monkeypatch, capsys):
    ckpt, _ = smollm2
    the_work_is_never_reached(monkeypatch, (generate, "load_model"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (bare / name).symlink_to(ckpt / name)
    message = one_line_error(capsys, generate.main, ["--checkpoint_path", str(bare), "--chat", "--prompt", "hi"])
    assert message == (f"error: {bare}: no chat template (chat_template.jinja, or tokenizer_config.json's "
                       "chat_template); convert a source that has one with scripts/convert_checkpoint.py, or drop "
                       "--chat")
    (bare / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    message = one_line_error(capsys, generate.main, ["--checkpoint_path", str(bare), "--chat", "--prompt", "hi"])
    assert message == (f"error: {bare / 'chat_template.jinja'}: the chat template failed to render (TemplateError: "
                       "roles must alternate)")
    (bare / "chat_template.jinja").write_text("{{ messages.append({'role': 'user'}) }}")  # the sandbox refuses
    assert "failed to render (SecurityError: access to attribute 'append' of 'list' object is unsafe" in \
        one_line_error(capsys, generate.main, ["--checkpoint_path", str(bare), "--chat", "--prompt", "hi"])
    (bare / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")  # nor does Python's inside
    assert "(SecurityError: access to attribute '__class__' of 'list' object is unsafe" in \
        one_line_error(capsys, generate.main, ["--checkpoint_path", str(bare), "--chat", "--prompt", "hi"])
    (bare / "chat_template.jinja").write_text("{% if add_generation_prompt is none %}x{% endif %}")
    assert one_line_error(capsys, generate.main, ["--checkpoint_path", str(bare), "--chat", "--prompt", "hi"]) == \
        f"error: {bare / 'chat_template.jinja'}: the chat template rendered no tokens for this conversation"
    (bare / "chat_template.jinja").write_text("{% for m in messages %}")
    assert "the chat template does not parse" in one_line_error(capsys, generate.main,
                                                                ["--checkpoint_path", str(bare), "--chat"])
    message = one_line_error(capsys, generate.main, ["--checkpoint_path", str(ckpt), "--chat", "--batch_size", "2"])
    assert message == "error: --chat holds one conversation: drop --batch_size and --num_samples"


def test_the_end_of_turn_is_the_token_the_template_closes_a_reply_with(smollm2):
    ckpt, _ = smollm2
    tokenizer = Tokenizer(ckpt)
    assert ChatTemplate(ckpt).end_of_turn(tokenizer) == {tokenizer.encode("<|im_end|>", bos=False)[0]}


def test_a_reply_cut_by_max_new_tokens_says_so(smollm2, monkeypatch):
    """A reply that --max_new_tokens ends before the template's end of turn says so in one line (and its JSON
    record has cut true); a whole reply says nothing."""
    ckpt, _ = smollm2
    cut = cli("--checkpoint_path", ckpt, "--chat", "--temperature", "0", "--max_new_tokens", "4", "--prompt",
              MESSAGES[0])
    assert cut.returncode == 0 and "[the reply was cut at --max_new_tokens 4; raise it" in cut.stderr
    whole = cli("--checkpoint_path", ckpt, "--chat", "--temperature", "0", "--max_new_tokens", "48", "--prompt",
                MESSAGES[0])
    assert whole.returncode == 0 and "cut at" not in whole.stderr
    records, _ = chat(monkeypatch, ckpt, "--max_new_tokens", "4", turns=MESSAGES[:1])
    assert [r["cut"] for r in records] == [True]
