"""Regeneration throughput: the in-process path, and the server path at 1, 4 and 16 requests in flight, on the same prompts.

    .venv/bin/python bench/regenerate.py [--target DIR] [--samples 32] [--max-new-tokens 64] [--methods inproc,server-1,server-4,server-16]

- inproc:     `regenerate(..., batch_size=B)`: HF `generate` in this machine's process (a fresh process per method).
- server-N:   `regenerate(..., server=URL, in_flight=N)` against one `transformers serve` process started here
              (`--continuous-batching` when the target has only full-attention layers; the embedded target's linear-attention
              layers are not supported by it, so that one is served request by request).

Tokens are those of the replies written, counted with the target's tokenizer, so every method is measured alike; the time
is the whole `regenerate` call (the in-process one includes loading the model, ~1 s here; the server was started before).
To measure an older version of the in-process path, put its package first on the path:
`git archive COMMIT dflash | tar -x -C /tmp/old && PYTHONPATH=/tmp/old .venv/bin/python bench/regenerate.py --methods inproc --label old`.
Results are appended to OUT/regenerate.jsonl.
"""
import argparse, json, os, platform, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def reply_tokens(target, out):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(l) for l in open(out)]
    n = sum(len(tok(m['content'], add_special_tokens=False)['input_ids']) for r in rows for m in r['messages'] if m['role'] == 'assistant')
    return len(rows), n, sum(r['truncated_turns'] for r in rows)


def run_method(method, a, url=None):
    "Run one method in this process; returns its figures."
    import torch, dflash.regenerate as R
    torch.set_num_threads(a.threads)
    out = Path(a.out) / f'{a.label}-{method}.jsonl'
    out.unlink(missing_ok=True)
    kw = dict(max_new_tokens=a.max_new_tokens, max_samples=a.samples, temperature=0.0)
    kw.update(dict(batch_size=a.batch_size) if method == 'inproc' else dict(server=url, in_flight=int(method.split('-')[1])))
    t0 = time.perf_counter()
    R.regenerate(a.target, a.data, str(out), **kw)
    el = time.perf_counter() - t0
    convs, toks, cut = reply_tokens(a.target, out)
    return dict(label=a.label, method=method, conversations=convs, reply_tokens=toks, truncated=cut, seconds=round(el, 2),
                tokens_per_s=round(toks / el, 1), batch_size=a.batch_size if method == 'inproc' else None,
                module=R.__file__, max_new_tokens=a.max_new_tokens)


def full_attention(target):
    c = json.loads((Path(target) / 'config.json').read_text())
    c = c.get('text_config', c)
    return all(t in ('full_attention', 'sliding_attention') for t in c.get('layer_types') or ['full_attention'])


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--target', default=None, help='a model directory; default: SmolLM2-135M-Instruct (dflash.gguf.smollm2())')
    p.add_argument('--data', default=str(ROOT / 'data' / 'real' / 'sharegpt-prompts-train.jsonl'))
    p.add_argument('--samples', type=int, default=32)
    p.add_argument('--max-new-tokens', type=int, default=64)
    p.add_argument('--batch-size', type=int, default=16, help='of the in-process path')
    p.add_argument('--threads', type=int, default=1, help='torch threads of the in-process path and of the server')
    p.add_argument('--methods', default='inproc,server-1,server-4,server-16')
    p.add_argument('--server-flags', default='auto', help="flags of transformers serve; auto: --continuous-batching when the target has only full attention")
    p.add_argument('--label', default='now')
    p.add_argument('--out', default=str(ROOT / 'runs' / 'bench'))
    p.add_argument('--method', help=argparse.SUPPRESS)
    p.add_argument('--url', help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.target is None:
        from dflash.gguf import smollm2
        a.target = str(smollm2())
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.method:   # child process
        print('RESULT ' + json.dumps(run_method(a.method, a, a.url)), flush=True); return
    env = {**os.environ, 'OMP_NUM_THREADS': str(a.threads), 'HF_HUB_OFFLINE': '1'}
    methods, server = a.methods.split(','), None
    try:
        for m in methods:
            if m.startswith('server') and server is None:
                from dflash.server import LocalServer
                flags = (['--continuous-batching'] if full_attention(a.target) else []) if a.server_flags == 'auto' else a.server_flags.split()
                server = LocalServer(a.target, *flags, env=env)
            cmd = [sys.executable, __file__, '--method', m, '--target', a.target, '--data', a.data, '--samples', str(a.samples),
                   '--max-new-tokens', str(a.max_new_tokens), '--batch-size', str(a.batch_size), '--threads', str(a.threads),
                   '--label', a.label, '--out', a.out] + (['--url', server.url] if server and m.startswith('server') else [])
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
            if r.returncode or not line: sys.exit(f'{m} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}')
            x = json.loads(line[0][7:])
            x.update(target=a.target, samples=a.samples, threads=a.threads, server_flags=' '.join(server.flags) if server and m.startswith('server') else None,
                     machine=f'{platform.machine()} {os.cpu_count()} cores', time=time.strftime('%Y-%m-%d %H:%M'))
            with open(Path(a.out) / 'regenerate.jsonl', 'a') as f: f.write(json.dumps(x) + '\n')
            print(f"{a.label:>8s} {m:10s} {x['conversations']:4d} conversations {x['reply_tokens']:6d} tokens {x['seconds']:7.1f} s "
                  f"{x['tokens_per_s']:7.1f} tok/s  ({x['truncated']} cut at {a.max_new_tokens})", flush=True)
    finally:
        if server: server.stop()


if __name__ == '__main__': main()
