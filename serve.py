"""The server: an OpenAI-compatible HTTP endpoint over one loaded model, whose requests share the rows of its static
KV cache (decoding.py's loop, a round at a time), plainly or with lossless speculation.

    python serve.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --compile [--draft_checkpoint DRAFT]
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template, as generate.py --chat), GET /v1/models,
GET /health; streamed as server-sent events or not. A request takes a free row at a round boundary (its prompt
prefilled in that row alone) and gives it back at its end: EOS or the template's end of turn, a stop string,
max_tokens, or its client gone. Greedy text is generate.py's for the same prompt alone, whatever else runs: each
row of a step is computed as it is alone (tests/test_cpu.py, test_serve.py). The model flags are generate.py's.
"""
import cli

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import asyncio
import collections
import contextlib
import json
import math
import sys
import threading
import time
import traceback
import uuid

import torch

from backend import report
from chat import Chat, ChatTemplate
from checkpoint import InputError, OneLineErrors, open_checkpoint
from decoding import Steps, most_drafts, spare_positions
from loading import DTYPES, add_model_flags, check_draft, check_model_options, load_model, make_drafter
from speculative import DraftLength, ModelDrafter, speculative_decode
from tokenizer import Tokenizer

IDLE = 1  # the position a free row sits at: its steps write slots nobody reads (a joining prompt overwrites them)


class Job:
    """One request's row: its prompt, limits and sampling; the engine fills in the rest and sends events
    (("text", delta) then ("done", finish_reason) or ("error", message)) to the event loop that waits for them."""

    def __init__(self, prompt, max_tokens, sampling, stop_ids, stops=(), seed=None, context=(), loop=None,
                 logged=True):
        self.prompt, self.max_tokens, self.sampling, self.logged = prompt, max_tokens, sampling, logged
        self.stop_ids, self.stops, self.seed, self.context = set(stop_ids), list(stops), seed, list(context)
        self.loop, self.events = loop, asyncio.Queue() if loop else None
        self.tokens, self.text, self.sent, self.finish = [], "", 0, None
        self.cancelled = False  # set by the HTTP side when the client is gone; the row is freed at the next round
        self.submitted, self.first_token_s, self.row = time.perf_counter(), None, None

    def send(self, *event):
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def add(self, tokens, tokenizer):
        """A round's new tokens, up to the first stop token (kept) or max_tokens; the text, cut at a stop string;
        sends what text is settled. -> whether the request is done."""
        for t in tokens:
            self.tokens.append(t)
            if t in self.stop_ids or len(self.tokens) == self.max_tokens:
                self.finish = "stop" if t in self.stop_ids else "length"
                break
        self.text = tokenizer.decode_after(self.context, [t for t in self.tokens if t not in self.stop_ids])
        settled = len(self.text)
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.finish, settled = self.text[:at], "stop", at
        if self.finish is None:  # hold back a partial character and what may yet begin a stop string
            settled = len(self.text.rstrip("\ufffd")) - max((len(s) - 1 for s in self.stops), default=0)
        if settled > self.sent:
            self.send("text", self.text[self.sent:settled])
            self.sent = settled
        return self.finish is not None


class Engine:
    """The model's rows shared by requests: `submit` queues a Job, `run` (the main thread) admits waiting jobs into
    free rows between rounds and runs rounds over the rows in use. A round runs over the first n rows of the cache
    (n: the smallest of 1, 2, 4, ... holding every row in use), so one request alone steps at batch 1. The rows of
    a round share one sampling setting: a request with another waits until the running ones end."""

    def __init__(self, model, steps, tokenizer, rows, cache_len, drafter=None, speculate_k=None):
        self.model, self.steps, self.tokenizer, self.drafter = model, steps, tokenizer, drafter
        self.cache_len, self.speculate_k = cache_len, speculate_k
        self.k_max = most_drafts(speculate_k, report(model).max_verify_tokens) if drafter else 0
        self.learns_lengths = bool(drafter) and speculate_k == "auto"
        self.lengths = {}  # batch size -> its DraftLength: a round's worth of drafts depends on its rows
        model.setup_caches(rows, cache_len)
        if isinstance(drafter, ModelDrafter):
            drafter.model.setup_caches(rows, cache_len)
        self.sizes = sorted({min(2 ** i, rows) for i in range(rows.bit_length() + 1)})
        self.rows = [None] * rows
        device = model.tok_embeddings.weight.device
        self.pos = torch.full((rows,), IDLE, device=device)  # each row's newest token's position (not yet cached)
        self.token = torch.zeros(rows, dtype=torch.long, device=device)  # plain decoding's next input
        self.histories = [[0, 0] for _ in range(rows)]
        self.cached_until = self.pos.clone()  # the draft model's cache, as ModelDrafter.cached_until
        self.sampling = None
        self.waiting = collections.deque()
        self.wake = threading.Condition()

    def submit(self, job: Job):
        with self.wake:
            self.waiting.append(job)
            self.wake.notify()

    def run(self):
        """Serve forever, in the main thread: torch's CPU thread pool is the main thread's (a step from another
        thread ran 2-3x slower here), and Ctrl-C reaches it there."""
        with torch.inference_mode():
            while True:
                with self.wake:
                    while not self.waiting and not any(self.rows):
                        self.wake.wait(0.5)
                self.step()

    def step(self):
        """Admit what fits, then one round over the rows in use (both guarded: a failure ends those requests with
        an error, not the server)."""
        for job in self.admissible():
            try:
                self.join(job)
            except Exception as e:
                self.fail([job], e)
        used = [b for b, job in enumerate(self.rows) if job is not None]
        if not used:
            return
        n = next(s for s in self.sizes if s > used[-1])
        try:
            self.round(n)
        except Exception as e:
            self.fail([self.rows[b] for b in used], e)

    def admissible(self) -> list[Job]:
        """Waiting jobs for the free rows, in order, while their sampling is the running rows' (cancelled ones
        dropped)."""
        jobs = []
        with self.wake:
            free = sum(job is None for job in self.rows)
            while self.waiting and len(jobs) < free:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                if (any(self.rows) or jobs) and job.sampling != self.sampling:
                    break
                self.sampling = job.sampling
                jobs.append(self.waiting.popleft())
        return jobs

    def join(self, job: Job):
        """Prefill the job's prompt into the lowest free row, alone: its first token."""
        b = self.rows.index(None)
        device = self.pos.device
        tokens = torch.tensor([job.prompt], device=device)
        positions = torch.arange(len(job.prompt), device=device)[None]
        if job.seed is not None:
            torch.manual_seed(job.seed)
        with self.model.cache_rows(b):
            first = self.steps.prefill(self.model, tokens, positions, positions[:, -1:], *self.sampling)
        if isinstance(self.drafter, ModelDrafter):
            with self.drafter.model.cache_rows(b):
                self.drafter.model(tokens, positions, positions[:, -1:] * 0)  # only its KV cache matters
        first = first.tolist()
        job.row, job.first_token_s = b, time.perf_counter() - job.submitted
        self.rows[b] = job
        self.pos[b] = self.cached_until[b] = len(job.prompt)
        self.token[b] = first[0]
        self.histories[b] = list(job.prompt) + first
        if job.add(first, self.tokenizer):
            self.end(b)

    def round(self, n: int):
        """One decode step, or one speculative round, over rows 0..n-1; rows not in use compute and are ignored."""
        jobs = self.rows[:n]
        active = [job is not None for job in jobs]
        running = torch.tensor(active, device=self.pos.device)
        pos = self.pos[:n]
        with self.model.cache_rows(0, n):
            if self.drafter is None:
                token = self.steps.decode(self.model, self.token[:n], pos, *self.sampling)
                self.token[:n] = token
                pos += running
                new = [[t] for t in token.tolist()]
            else:
                new = self.speculative_round(n, jobs, active, pos)
                pos += torch.tensor([len(t) for t in new], device=pos.device) * running
        for b, job in enumerate(jobs):
            if job is None:
                continue
            self.histories[b] += new[b]
            if job.cancelled or job.add(new[b], self.tokenizer):
                self.end(b)

    def speculative_round(self, n, jobs, active, pos) -> list[list[int]]:
        room = max(job.max_tokens - len(job.tokens) for job in jobs if job is not None)
        drafts = min(self.k_max, room - 1)  # a last round drafts only what its longest row can emit
        drafter = self.drafter
        length = self.lengths.setdefault(n, DraftLength(self.k_max)) if self.learns_lengths else None
        if length:
            length.set_threshold(length.start(active, drafts))
        model_drafter = isinstance(drafter, ModelDrafter)
        if model_drafter:
            drafter.cached_until = self.cached_until[:n].clone()
        with drafter.model.cache_rows(0, n) if model_drafter else contextlib.nullcontext():
            draft, accepted, next_token, timing, _ = speculative_decode(
                self.model, drafter, self.histories[:n], pos, self.steps.verify, *self.sampling, drafts=drafts,
                pad_to=1 if length else self.k_max, more=length.more if length else None)
        if model_drafter:
            self.cached_until[:n] = drafter.cached_until
        if length:
            length.update(accepted.tolist(), active, *timing)
        return [d[:m] + [t] for d, m, t in zip(draft.tolist(), accepted.tolist(), next_token.tolist())]

    def end(self, b: int):
        job = self.rows[b]
        self.rows[b] = None
        self.pos[b] = self.cached_until[b] = IDLE
        self.histories[b] = [0, 0]
        if job.cancelled:
            job.finish = "cancelled"
        if job.logged:  # before "done": a client that has its answer finds its line in the log
            log(job)
        if not job.cancelled:
            job.send("done", job.finish)

    def fail(self, jobs, error):
        print(f"error: a round failed ({type(error).__name__}: {error}); its requests end with an error",
              file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        for job in jobs:
            if job.row is not None and self.rows[job.row] is job:
                self.rows[job.row] = None
                self.pos[job.row] = self.cached_until[job.row] = IDLE
                self.histories[job.row] = [0, 0]
            job.send("error", f"the server failed on this request ({type(error).__name__}: {error})")


def log(job: Job):
    """One line a request: its tokens, speed and time to the first token."""
    took = time.perf_counter() - job.submitted
    after_first = took - (job.first_token_s or 0)
    speed = (len(job.tokens) - 1) / after_first if len(job.tokens) > 1 and after_first > 0 else 0.0
    print(f"request: {len(job.prompt)} prompt + {len(job.tokens)} tokens in {took:.2f} s ({speed:.1f} tok/s after "
          f"the first at {job.first_token_s or 0:.3f} s), row {job.row}, {job.finish}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the HTTP API

class BadRequest(Exception):
    """A request the server refuses: an OpenAI-shaped error naming the field, status 400 unless said."""

    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message, param=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def number(body, name, default, low, high, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise BadRequest(f"{name}: {'an integer' if integer else 'a number'} expected, not {short(value)}", name)
    if not math.isfinite(value) or not (low < value if low_open else low <= value) or value > high:
        raise BadRequest(f"{name}: {value} is outside {'(' if low_open else '['}{low}, {high}]", name)
    return value


def short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Service:
    """What the endpoints share: the engine, the tokenizer, the chat (None without a template), the limits."""

    def __init__(self, engine, tokenizer, chat, name, speculate_k):
        self.engine, self.tokenizer, self.chat, self.name = engine, tokenizer, chat, name
        self.spare, self.created = spare_positions(speculate_k), int(time.time())

    def job(self, body, prompt, default_max_tokens, stop_ids, context, loop) -> Job:
        """The request's fields as a Job (BadRequest naming the first bad one)."""
        if body.get("model") not in (None, self.name):
            raise BadRequest(f"model {short(body['model'])}: not served here; GET /v1/models lists '{self.name}'",
                             "model")
        if body.get("n", 1) != 1:
            raise BadRequest(f"n: {short(body['n'])}: only n = 1 is served (send the request again for more)", "n")
        room = self.engine.cache_len - len(prompt) - self.spare
        if room < 1:
            raise BadRequest(f"the prompt ({len(prompt)} tokens) leaves no room in the {self.engine.cache_len} "
                             "positions a request may hold here (serve.py --max_context); shorten it", "prompt")
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = number(body, name, default_max_tokens or room, 1, math.inf, integer=True)
        if max_tokens > room:
            raise BadRequest(f"{name}: the prompt ({len(prompt)} tokens) + {max_tokens} exceeds the "
                             f"{self.engine.cache_len} positions a request may hold here (serve.py --max_context"
                             f"{', with a verify' + chr(39) + 's ' + str(self.spare) + ' spare' if self.spare else ''});"
                             f" ask for at most {room}", name)
        temperature = number(body, "temperature", 1.0, 0, 2)
        top_p = number(body, "top_p", 1.0, 0, 1, low_open=True)
        seed = number(body, "seed", None, -2 ** 63, 2 ** 64 - 1, integer=True)
        stops = body.get("stop")
        stops = [stops] if isinstance(stops, str) else stops if stops is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest(f"stop: a non-empty string or a list of at most 4, not {short(body['stop'])}", "stop")
        for flag in ("stream",):
            if not isinstance(body.get(flag, False), bool):
                raise BadRequest(f"{flag}: true or false, not {short(body[flag])}", flag)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(f"stream_options: an object such as {{\"include_usage\": true}}, not "
                             f"{short(body['stream_options'])}", "stream_options")
        sampling = (float(temperature), None, None if top_p == 1 else float(top_p))
        return Job(prompt, max_tokens, sampling, stop_ids, stops, None if seed is None else seed % 2 ** 64, context,
                   loop)

    def completion_prompt(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            tokens, vocab = prompt, self.engine.model.args.vocab_size
            if not all(0 <= t < vocab for t in tokens):
                raise BadRequest(f"prompt: token ids are in [0, {vocab})", "prompt")
        else:
            raise BadRequest("prompt: a string or a list of token ids (one prompt a request), not "
                             f"{short(prompt)}", "prompt")
        if not tokens:
            raise BadRequest("prompt: no tokens; give some text", "prompt")
        return tokens

    def chat_prompt(self, body) -> list[int]:
        if self.chat is None:
            raise BadRequest(f"this checkpoint has no chat template ({self.name}); use /v1/completions", "messages",
                             status=400)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(f"messages: a non-empty list of {{\"role\", \"content\"}} objects, not "
                             f"{short(messages)}", "messages")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise BadRequest(f"messages[{i}]: an object whose role is system, user, assistant or tool, not "
                                 f"{short(m)}", f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
                raise BadRequest(f"messages[{i}].content: a string (or text parts), not {short(content)}",
                                 f"messages[{i}].content")
            rendered.append({"role": m["role"], "content": content or ""})
        try:
            text = self.chat.template.render(rendered, add_generation_prompt=True)
        except InputError as e:
            raise BadRequest(f"messages: {e}", "messages") from None
        tokens = self.tokenizer.encode(text, bos=False)  # the template writes the BOS it wants, as --chat feeds it
        if not tokens:
            raise BadRequest("messages: the chat template rendered no tokens", "messages")
        return tokens


def make_app(service: Service):
    """The Starlette app over a Service (a function, so that tests may serve one in-process too)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def read_body(request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the body is a JSON {type(body).__name__}, not an object")
        return body

    async def serve(request, chat: bool):
        kind = "chat.completion" if chat else "text_completion"
        try:
            body = await read_body(request)
            prompt = service.chat_prompt(body) if chat else service.completion_prompt(body)
            stop_ids = service.chat.stop_ids if chat else service.tokenizer.eos_ids
            job = service.job(body, prompt, None if chat else 16, stop_ids, () if chat else prompt,
                              asyncio.get_running_loop())
        except BadRequest as e:
            print(f"refused ({e.status}): {e}", file=sys.stderr, flush=True)
            return JSONResponse(error_body(str(e), e.param), status_code=e.status)
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                    model=service.name)

        def usage():
            return dict(prompt_tokens=len(job.prompt), completion_tokens=len(job.tokens),
                        total_tokens=len(job.prompt) + len(job.tokens))

        def choice(text, finish, streamed):
            if not chat:
                return dict(index=0, text=text, logprobs=None, finish_reason=finish)
            if not streamed:
                return dict(index=0, message=dict(role="assistant", content=text), logprobs=None,
                            finish_reason=finish)
            return dict(index=0, delta={} if finish else dict(content=text), logprobs=None, finish_reason=finish)

        service.engine.submit(job)
        if body.get("stream"):
            include_usage = (body.get("stream_options") or {}).get("include_usage", False)

            def chunk(**fields):
                return f"data: {json.dumps(dict(head, object=kind + ('.chunk' if chat else ''), **fields))}\n\n"

            async def events():
                try:
                    if chat:
                        yield chunk(choices=[dict(index=0, delta=dict(role="assistant", content=""),
                                                  logprobs=None, finish_reason=None)])
                    while True:
                        event = await job.events.get()
                        if event[0] == "text":
                            yield chunk(choices=[choice(event[1], None, True)])
                        elif event[0] == "done":
                            yield chunk(choices=[choice("", event[1], True)])
                            if include_usage:
                                yield chunk(choices=[], usage=usage())
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            yield f"data: {json.dumps(error_body(event[1], kind='server_error'))}\n\n"
                            return
                finally:  # the client gone (or the stream over): the engine frees the row at the next round
                    job.cancelled = True

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return JSONResponse(error_body("the client closed the connection"), status_code=499)
                continue
            if event[0] == "done":
                return JSONResponse(dict(head, object=kind, choices=[choice(job.text, event[1], False)],
                                         usage=usage()))
            if event[0] == "error":
                return JSONResponse(error_body(event[1], kind="server_error"), status_code=500)

    async def completions(request):
        return await serve(request, chat=False)

    async def chat_completions(request):
        return await serve(request, chat=True)

    async def models(request):
        return JSONResponse(dict(object="list", data=[dict(id=service.name, object="model",
                                                           created=service.created, owned_by="fastdecode")]))

    async def health(request):
        return JSONResponse(dict(status="ok"))

    async def http_error(request, exc):
        message = {404: f"{request.url.path}: no such path; the API has /v1/completions, /v1/chat/completions, "
                        "/v1/models and /health",
                   405: f"{request.method} {request.url.path}: not allowed"}.get(exc.status_code, exc.detail)
        print(f"refused ({exc.status_code}): {message}", file=sys.stderr, flush=True)
        return JSONResponse(error_body(message), status_code=exc.status_code)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"])],
                     exception_handlers={HTTPException: http_error})


# ---------------------------------------------------------------- the command line

def build_parser():
    p = OneLineErrors(description="Serve a converted checkpoint over an OpenAI-compatible HTTP API; concurrent "
                      "requests share the model's rows.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--batch_size", type=int, default=4, help="requests served at once: the rows of the shared "
                   "cache (more wait for a free row)")
    p.add_argument("--max_context", type=int, default=2048, help="the positions a request may hold: its prompt, "
                   "max_tokens and, when speculating, a verify's spare (at most config.json max_seq_len)")
    p.add_argument("--name", default=None, help="the model's id in the API (default: the checkpoint directory's "
                   "name)")
    return p


def check_port(host: str, port: int):
    """Before anything loads: the address must be free, or the user waits for a load that cannot serve."""
    import socket
    if not 0 < port < 65536:
        raise InputError(f"--port {port}: must be in 1..65535")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); pick another "
                         "--port or stop what holds it") from None


def warm_up(engine: Engine, tokenizer, steps_per_job: int):
    """Compile every batch size's graphs before the first request: as many jobs as each size holds, greedy."""
    for size in engine.sizes:
        for _ in range(size):
            engine.submit(Job(tokenizer.encode("Hello"), steps_per_job, (0.0, None, None), tokenizer.eos_ids,
                              logged=False))
        while engine.waiting or any(engine.rows):
            engine.step()
    engine.lengths.clear()  # the warm-up's rounds timed its compiles: draft lengths are learned from real rounds


def main(argv=None):
    opts = build_parser().parse_args(argv)
    check_model_options(opts)
    if opts.nproc_per_node > 1:
        raise InputError("--nproc_per_node: serve.py runs in one process for now (tensor parallelism is "
                         "generate.py's); drop it")
    if opts.batch_size < 1 or opts.max_context < 1:
        raise InputError("--batch_size and --max_context must be at least 1")
    check_port(opts.host, opts.port)
    target = open_checkpoint(opts.checkpoint_path)
    tokenizer = Tokenizer(target.directory, target.config)
    draft = check_draft(opts, tokenizer, target)
    try:
        chat = Chat(ChatTemplate(target.directory), tokenizer)
    except InputError:
        chat = None  # /v1/chat/completions says so
    cache_len = min([opts.max_context, target.args.max_seq_len] + ([draft.args.max_seq_len] if draft else []))
    t = time.perf_counter()
    model = load_model(target, opts.device, DTYPES[opts.dtype], backend=opts.backend)
    drafter = make_drafter(opts.draft or ("model" if opts.draft_checkpoint else None), draft, opts.device,
                           DTYPES[opts.dtype], opts.backend, opts.compile, None, opts.draft_quantize or "auto",
                           vocab=opts.draft_vocab)
    load_s = time.perf_counter() - t
    speculate_k = opts.speculate_k if drafter else None
    engine = Engine(model, Steps(opts.compile, opts.compile_prefill, opts.device), tokenizer, opts.batch_size,
                    cache_len, drafter, speculate_k)
    t = time.perf_counter()
    with torch.inference_mode():
        warm_up(engine, tokenizer, 12 if drafter else 3)
    warm_s = time.perf_counter() - t
    name = opts.name or target.directory.name
    service = Service(engine, tokenizer, chat, name, speculate_k)
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(make_app(service), host=opts.host, port=opts.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))
    http = threading.Thread(target=server.run, name="http", daemon=True)  # the HTTP side: its own event loop
    http.start()
    while not server.started:
        if not http.is_alive():
            raise InputError(f"--host {opts.host} --port {opts.port}: the server could not start there")
        time.sleep(0.05)
    print(f"serving {name} on http://{opts.host}:{opts.port}/v1 ({opts.batch_size} rows of {cache_len} positions"
          + (f", drafted by {getattr(drafter, 'form', None) or 'n-grams'} at K {speculate_k}" if drafter else "")
          + f"; loaded in {load_s:.1f} s, warmed up in {warm_s:.1f} s)", file=sys.stderr, flush=True)
    try:
        engine.run()  # until Ctrl-C: the tools' one line, exit 130
    finally:
        server.should_exit = True


if __name__ == "__main__":
    cli.run(main, on_interrupt="serve.py: stopped")
