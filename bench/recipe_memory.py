"""Peak resident memory of a training job at the recipe's defaults, as a new user runs it: `dflash_train --target DIR` on a
stock-like target (a random-weight Qwen3.5 hybrid of 8 layers, hidden 128, saved with the embedded tokenizer), the
embedded train split, every other setting the recipe's (2 target ranks + 1 drafter rank, 5 drafter layers, 512 anchors,
token budget 16384, max_length 3072; for this hybrid target 4 sliding layers + 1 full, window 2048). A few steps, then the
peak of the largest rank (`RUSAGE_CHILDREN`) and the drafter's own `peak_mem_bytes` from metrics.jsonl.

    python bench/recipe_memory.py [--steps 4] [--layer-types full,full,full,full,full]
"""
import argparse, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path

BIN = Path(sys.executable).parent


def main(a):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from dflash.core import TINY_TARGET, read_metrics
    from dflash.tiny_target import target_config
    d = Path(tempfile.mkdtemp(prefix='recipe-memory-'))
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(target_config(tok, hidden=128, layers=8)).save_pretrained(d / 'target'); tok.save_pretrained(d / 'target')
    cmd = [BIN / 'dflash_train', '--target', d / 'target', '--out', d / 'run', '--max-steps', a.steps, '--no-final-eval', '--no-progress',
           '--log-every', 1] + (['--layer-types', a.layer_types] if a.layer_types else [])
    print('$', ' '.join(map(str, cmd)), flush=True)
    t0 = time.time()
    r = subprocess.run(list(map(str, cmd)), env={**os.environ, 'HF_HUB_OFFLINE': '1'}, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode: print(r.stdout[-3000:], r.stderr[-3000:]); sys.exit(r.returncode)
    cfg = json.loads((d / 'run' / 'config.json').read_text())['config']
    m = [x for x in read_metrics(d / 'run') if 'loss' in x]
    res = dict(steps=len(m), wall_s=round(wall, 1), largest_rank_peak_gb=round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
               drafter_peak_mem_gb=round(max(x.get('peak_mem_bytes', 0) for x in m) / 2**30, 2), tokens_per_s=round(m[-1].get('tokens_per_s', 0)),
               settings={k: cfg[k] for k in ('targets', 'drafters', 'num_layers', 'layer_types', 'sliding_window', 'num_anchors', 'token_budget', 'max_length')})
    print(json.dumps(res))


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--steps', type=int, default=4); ap.add_argument('--layer-types', default=None)
    main(ap.parse_args())
