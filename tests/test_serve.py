"""serve.py as a client sees it: a real server process on localhost, the official `openai` client and plain HTTP.
Greedy text is generate.py's for the same prompt alone (its CLI once, then the loop it runs, decoding.generate, on
the same model in this process), also with 8 clients at once sharing the rows; a client that drops its stream frees
its row; bad requests are 4xx errors naming the field, and the server goes on."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from cli import humaneval_tasks
from conftest import ROOT
from decoding import Steps, generate
from loading import load_model
from tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"  # the demo checkpoint's directory name: the id the server gives it
openai = pytest.importorskip("openai", reason="the openai client is a test requirement (requirements-dev.txt)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """serve.py in its own process; its stderr kept in a file (one line a request)."""

    def __init__(self, tmp_path, *flags):
        self.port, self.log = free_port(), tmp_path / f"serve-{time.monotonic_ns()}.log"
        self.process = subprocess.Popen([sys.executable, "serve.py", "--port", str(self.port), *map(str, flags)],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(self.url("/health"), timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not answer /health in 600 s: " + self.log.read_text()[-3000:])
        self.client = openai.OpenAI(base_url=self.url("/v1"), api_key="unused", max_retries=0, timeout=600)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path, body: bytes, method="POST"):
        """-> (status, the JSON body)"""
        request = urllib.request.Request(self.url(path), data=body if method == "POST" else None, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def stream_text(stream, chat=False) -> str:
    pieces = []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append((choice.delta.content if chat else choice.text) or "")
    return "".join(pieces)


@pytest.fixture(scope="module")
def smollm2_server(smollm2, tmp_path_factory):
    ckpt, _ = smollm2
    server = Server(tmp_path_factory.mktemp("serve"), "--checkpoint_path", ckpt, "--batch_size", 8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def solo(smollm2):
    """The greedy text of a prompt alone (completion: after the prompt; chat: the reply), as generate.py computes it:
    decoding.generate on the same model (bf16, the CPU backend, eager) in this process."""
    ckpt, _ = smollm2
    model, tokenizer = load_model(ckpt, "cpu", torch.bfloat16), Tokenizer(ckpt)

    def text(prompt_ids, max_tokens, stop_ids=None, context=None):
        stop_ids = tokenizer.eos_ids if stop_ids is None else stop_ids
        rows, _ = generate(model, [prompt_ids], max_tokens, Steps(), eos_ids=stop_ids)
        return tokenizer.decode_after(prompt_ids if context is None else context,
                                      [t for t in rows[0] if t not in stop_ids])
    return text, tokenizer


def cli_text(*args) -> str:
    result = subprocess.run([sys.executable, "generate.py", "--temperature", "0", "--json", *map(str, args)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[0])["text"]


def test_completion_and_chat_are_generate_py_s_text(smollm2, smollm2_server):
    """Greedy, streamed and not: the text generate.py prints for the same prompt (and --chat's reply)."""
    ckpt, _ = smollm2
    client = smollm2_server.client
    prompt = "def fibonacci(n):"
    want = cli_text("--checkpoint_path", ckpt, "--prompt", prompt, "--max_new_tokens", 40)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 40 and whole.usage.prompt_tokens == whole.usage.total_tokens - \
        whole.usage.completion_tokens
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    assert stream_text(streamed) == want
    message = "Name three prime numbers."
    want = cli_text("--checkpoint_path", ckpt, "--chat", "--prompt", message, "--max_new_tokens", 48)
    reply = client.chat.completions.create(model=MODEL, max_tokens=48, temperature=0,
                                           messages=[{"role": "user", "content": message}])
    assert reply.choices[0].message.content == want and reply.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}],
                                              max_tokens=48,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens and not chunks[-1].choices
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert client.models.list().data[0].id == MODEL


def test_a_stop_string_ends_the_text_before_it(smollm2_server, solo):
    text, tokenizer = solo
    prompt = "def fibonacci(n):"
    full = text(tokenizer.encode(prompt), 40)
    stop = full[full.index("return"):][:8]  # a stop string inside the text: the text ends right before it
    for stream in (False, True):
        got = smollm2_server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                       stop=[stop], stream=stream)
        assert (stream_text(got) if stream else got.choices[0].text) == full[:full.index(stop)], stream


def test_eight_clients_at_once_each_get_their_own_text(smollm2_server, solo):
    """8 HumanEval prompts sent together (half streamed), rows joining and leaving as they end: each text is that
    prompt's own greedy text alone."""
    text, tokenizer = solo
    prompts = [t["prompt"] for t in humaneval_tasks(8)]
    lengths = [24, 40, 16, 32, 24, 48, 20, 36]  # rows end at different rounds; later ones run beside them
    got = [None] * 8

    def ask(i):
        client = openai.OpenAI(base_url=smollm2_server.url("/v1"), api_key="unused", max_retries=0, timeout=600)
        answer = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                           stream=i % 2 == 1)
        got[i] = stream_text(answer) if i % 2 else answer.choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        assert got[i] == text(tokenizer.encode(prompts[i]), lengths[i]), i


def test_a_client_dropping_its_stream_frees_its_row(smollm2_server):
    client = smollm2_server.client
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1500, temperature=0,
                                       stream=True)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()  # after two chunks
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and ", cancelled" not in smollm2_server.log.read_text():
        time.sleep(0.2)
    line = next(line for line in smollm2_server.log.read_text().splitlines() if line.endswith(", cancelled"))
    assert int(line.split(" prompt + ")[1].split()[0]) < 1500, line  # freed long before its max_tokens
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0).choices[0].text


BAD = [  # (path, body, the field or words the message names)
    ("/v1/completions", b"{", "not JSON"),
    ("/v1/completions", b"[1, 2]", "not an object"),
    ("/v1/completions", b"{}", "prompt"),
    ("/v1/completions", b'{"prompt": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": [999999999]}', "token ids"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "word " * 3000}).encode(), "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', "n"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 5}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-9"}', "model"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"prompt": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', "role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    ("/v1/embeddings", b'{"input": "hi"}', "no such path"),
]


def test_bad_requests_are_4xx_errors_that_name_the_field_and_the_server_goes_on(smollm2_server):
    for path, body, words in BAD:
        status, answer = smollm2_server.post(path, body)
        assert status == (404 if "path" in words else 400), (path, body, status, answer)
        message = answer["error"]["message"]
        assert words in message and "\n" not in message, (body, message)
    status, answer = smollm2_server.post("/v1/completions", b"", method="GET")
    assert status == 405 and "not allowed" in answer["error"]["message"]
    good = smollm2_server.client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    assert good.usage.completion_tokens >= 1


def test_each_request_is_one_log_line_and_ctrl_c_stops_it_in_one_line(smollm2_server):
    """(runs last in this file: it stops the module's server)"""
    lines = smollm2_server.log.read_text().splitlines()
    served = [line for line in lines if line.startswith("request: ")]
    assert len(served) >= 17 and all("tok/s" in line and "first at" in line for line in served)
    assert sum(line.startswith("refused (4") for line in lines) == len(BAD) + 1
    assert smollm2_server.stop() == 130
    tail = smollm2_server.log.read_text().splitlines()[len(lines):]
    assert tail == ["serve.py: stopped"], tail


def test_startup_errors_are_one_line(smollm2, tmp_path):
    ckpt, _ = smollm2
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run([sys.executable, "serve.py", "--checkpoint_path", str(ckpt), "--port", str(port)],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.startswith(f"error: --host 127.0.0.1 --port {port}: cannot "
                                                               "listen there"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = subprocess.run([sys.executable, "serve.py", "--checkpoint_path", str(tmp_path / "nope")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "nope" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_qwen_pair_served_with_its_draft_gives_the_target_s_own_text(tmp_path):
    """The 1.5B drafted by the 0.5B (int4, K auto), two rows: a completion and a chat at once, streamed and not, each
    the 1.5B's own plain greedy text alone."""
    import fetch_models
    from chat import Chat, ChatTemplate
    target_dir, draft_dir = fetch_models.fetch("qwen2.5-coder-1.5b"), fetch_models.fetch("qwen2.5-coder-0.5b")
    tokenizer = Tokenizer(target_dir)
    prompt, message = humaneval_tasks(1)[0]["prompt"], "Write a Python function that reverses a string."
    chat = Chat(ChatTemplate(target_dir), tokenizer)
    chat_ids, _ = chat.ask(message)
    model = load_model(target_dir, "cpu", torch.bfloat16)
    rows, _ = generate(model, [tokenizer.encode(prompt)], 32, Steps(), eos_ids=tokenizer.eos_ids)
    want_completion = tokenizer.decode_after(tokenizer.encode(prompt), [t for t in rows[0]
                                                                        if t not in tokenizer.eos_ids])
    rows, _ = generate(model, [chat_ids], 40, Steps(), eos_ids=chat.stop_ids)
    want_reply = tokenizer.decode([t for t in rows[0] if t not in chat.stop_ids])
    del model
    server = Server(tmp_path, "--checkpoint_path", target_dir, "--draft_checkpoint", draft_dir, "--speculate_k",
                    "auto", "--batch_size", 2)
    try:
        got = {}
        name = target_dir.name

        def complete():
            answer = server.client.completions.create(model=name, prompt=prompt, max_tokens=32, temperature=0,
                                                      stream=True)
            got["completion"] = stream_text(answer)

        thread = threading.Thread(target=complete)
        thread.start()
        reply = server.client.chat.completions.create(model=name, max_tokens=40, temperature=0,
                                                      messages=[{"role": "user", "content": message}])
        thread.join()
        assert got["completion"] == want_completion
        assert reply.choices[0].message.content == want_reply
        assert "drafted by int4" in server.log.read_text()
    finally:
        assert server.stop() == 130


def test_the_warm_up_leaves_no_learned_draft_lengths_and_each_batch_size_learns_its_own(smollm2):
    checkpoint = smollm2[0]
    """The warm-up's rounds time its compiles: a learner kept from them drafted one token a round after it (1.48x
    instead of 2.52x on the Qwen pair, docs/performance.md). Each batch size then learns from its own rounds."""
    from loading import make_drafter
    from serve import Engine, Job, warm_up
    tokenizer = Tokenizer(checkpoint)
    model = load_model(checkpoint, "cpu", torch.bfloat16)
    engine = Engine(model, Steps(), tokenizer, 2, 512, make_drafter("ngram"), "auto")
    prompt = tokenizer.encode(humaneval_tasks(1)[0]["prompt"])
    with torch.inference_mode():
        warm_up(engine, tokenizer, 12)
        assert engine.lengths == {}
        job = Job(prompt, 24, (0.0, None, None), tokenizer.eos_ids, logged=False)
        engine.submit(job)
        while engine.waiting or any(engine.rows):
            engine.step()
    assert set(engine.lengths) == {1}
    alone, _ = generate(model, [prompt], 24, Steps(), eos_ids=tokenizer.eos_ids)
    assert job.tokens == alone[0]
