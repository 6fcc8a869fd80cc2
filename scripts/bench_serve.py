"""Load on a running serve.py: N concurrent streaming clients for a fixed count of greedy requests (HumanEval
prompts), at each N asked. First each request alone, one after another: its text is the reference, and that pass
is the 1-client row. Then at each N: aggregate tok/s (completion tokens over the wall time), each request's own
tok/s (after its first token), the time to the first token (median and p90), and what was lost: a request that
failed or whose text is not its solo text.

    python serve.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --compile --batch_size 8 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --clients 2,4,8 --requests 16 --max_tokens 64

--baseline URL2 (another server of the same model, e.g. served plainly where --url speculates): before the levels,
each request runs alone on URL2 and then on --url, in turns, so that a shared machine's drift reaches both alike;
printed: each one's tok/s after the first token, the ratio request by request (median and range), and whether the
texts are equal (greedy speculation is lossless).
"""
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cli  # noqa: E402


def parse(argv):
    p = cli.OneLineErrors(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (serve.py)")
    p.add_argument("--clients", default="2,4,8", help="concurrent clients, comma-separated (1 is the solo pass)")
    p.add_argument("--requests", type=int, default=16, help="requests at each level (HumanEval's first prompts)")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens a request asks for (greedy)")
    p.add_argument("--baseline", help="another server of the same model: each request alone there and on --url, in "
                   "turns, first (their speed ratio)")
    opts = p.parse_args(argv)
    try:
        opts.clients = [int(c) for c in opts.clients.split(",") if c]
    except ValueError:
        raise cli.InputError(f"--clients {opts.clients}: comma-separated integers, such as 2,4,8") from None
    if not opts.clients or min(opts.clients) < 1 or opts.requests < 1 or opts.max_tokens < 1:
        raise cli.InputError("--clients, --requests and --max_tokens must be at least 1")
    return opts


def one(client, model, prompt, max_tokens) -> dict:
    """A streamed greedy request: its text, tokens, time to the first text and time in all."""
    start = time.perf_counter()
    first, pieces, tokens = None, [], 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text and first is None:
                first = time.perf_counter() - start
            pieces.append(choice.text or "")
    took = time.perf_counter() - start
    return dict(text="".join(pieces), tokens=tokens, first=first or took, took=took)


def level(make_client, model, prompts, max_tokens, clients) -> tuple[list, float]:
    """Every prompt once, `clients` at a time: -> (each one's result or the error it met, the wall time)."""
    results, queue, lock = [None] * len(prompts), list(range(len(prompts))), threading.Lock()

    def worker():
        client = make_client()
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            try:
                results[i] = one(client, model, prompts[i], max_tokens)
            except Exception as e:  # lost: counted, not fatal
                results[i] = dict(error=f"{type(e).__name__}: {e}")
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def after_first(r) -> float | None:
    """A request's tok/s after its first token."""
    return (r["tokens"] - 1) / (r["took"] - r["first"]) if r["tokens"] > 1 and r["took"] > r["first"] else None


def in_turns(make_client, url, baseline, model, prompts, max_tokens):
    """Each prompt alone on the baseline server, then on `url`: their speeds side by side, and equal texts."""
    here, there = make_client(url), make_client(baseline)
    base_model = there.models.list().data[0].id
    print(f"| request | {baseline} tok/s | {url} tok/s | ratio | same text |\n|---|---|---|---|---|")
    ratios, same = [], 0
    for i, prompt in enumerate(prompts):
        b = one(there, base_model, prompt, max_tokens)
        r = one(here, model, prompt, max_tokens)
        speeds = after_first(b), after_first(r)
        ratio = speeds[1] / speeds[0] if all(speeds) else None
        ratios += [ratio] if ratio else []
        same += b["text"] == r["text"]
        print(f"| {i} | {speeds[0] or 0:.2f} | {speeds[1] or 0:.2f} | {ratio or 0:.2f} | {b['text'] == r['text']} |",
              flush=True)
    if ratios:
        print(f"ratio {url} / {baseline}: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-"
              f"{max(ratios):.2f}x over {len(ratios)} requests; {same} of {len(prompts)} texts equal\n", flush=True)


def p90(values):
    return sorted(values)[max(0, -(-9 * len(values) // 10) - 1)]


def main(argv=None):
    opts = parse(argv)
    openai = cli.require("openai", "scripts/bench_serve.py")

    def make_client(url=opts.url):
        return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=3600)
    for flag, url in (("--baseline", opts.baseline), ("--url", opts.url)):
        try:
            model = make_client(url).models.list().data[0].id if url else None
        except openai.APIConnectionError:
            raise cli.InputError(f"{flag} {url}: no server answers there; start serve.py first") from None
    prompts = [t["prompt"] for t in cli.humaneval_tasks(opts.requests)]
    print(f"{model} at {opts.url}: {opts.requests} greedy requests of {opts.max_tokens} tokens a level",
          file=sys.stderr)
    if opts.baseline:
        in_turns(make_client, opts.url, opts.baseline, model, prompts, opts.max_tokens)
    print("| clients | aggregate tok/s | x 1 client | request tok/s (median) | first token median / p90 | lost |")
    print("|---|---|---|---|---|---|")
    solo, base = None, None
    for clients in [1] + [c for c in opts.clients if c != 1]:
        results, wall = level(make_client, model, prompts, opts.max_tokens, clients)
        if solo is None:
            solo = results
        lost = sum("error" in r or "error" in s or r["text"] != s["text"] for r, s in zip(results, solo))
        done = [r for r in results if "error" not in r]
        tokens = sum(r["tokens"] for r in done)
        aggregate = tokens / wall
        base = base or aggregate
        speeds = [s for s in map(after_first, done) if s]
        firsts = [r["first"] for r in done]
        print(f"| {clients} | {aggregate:.1f} | {aggregate / base:.2f} | "
              f"{statistics.median(speeds) if speeds else 0:.1f} | "
              f"{statistics.median(firsts) if firsts else 0:.3f} / {p90(firsts) if firsts else 0:.3f} s | "
              f"{lost} of {len(results)} |", flush=True)
        for r in results:
            if "error" in r:
                print(f"  lost: {r['error']}", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main)
