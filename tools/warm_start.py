"""Warm start against random weights, at equal steps, on the real target (SmolLM2-135M-Instruct).

The checkpoint to start from stands in for a published drafter: one trained on the first 264 conversations
(`tools/data_curve.py`, 88 steps). Two runs then train for the same number of steps on the real demo's whole
extraction (1056 conversations), with the same settings: one from random weights, one `--init-from` the checkpoint.
All three drafters are measured in one process on the same prompts. Run `make real-demo` and `tools/data_curve.py` first.

    python tools/warm_start.py --steps 60
"""
import argparse, json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REAL = ROOT / 'data' / 'real'


def train(target, extracted, out, a, init_from=None):
    if (out / 'drafter' / 'model.safetensors').exists(): return out / 'drafter'
    cmd = [BIN / 'dflash_train', '--target', target, '--extracted', extracted, '--out', out, '--drafters', 1, '--max-steps', a.steps,
           '--num-anchors', 16, '--token-budget', 2048, '--lr', a.lr, '--warmup', 0.05, '--min-lr-ratio', 0.1, '--no-final-eval',
           '--no-progress', '--log-every', 10, '--overwrite'] + (['--init-from', init_from] if init_from else [])
    print('$', ' '.join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, env={**os.environ, 'HF_HUB_OFFLINE': '1'}, stdout=subprocess.DEVNULL)
    return out / 'drafter'


def main(a):
    from dflash.evaluate import TauProbe, NgramDrafter, load_drafter
    from dflash.core import read_metrics
    out, demo, start = Path(a.out), Path(a.demo), Path(a.start)
    target = json.loads((demo / 'extract' / 'manifest.json').read_text())['target']
    d = {'start (264 conversations, 88 steps)': start,
         f'random weights + {a.steps} steps': train(target, demo / 'extract', out / 'scratch', a),
         f'warm start + {a.steps} steps': train(target, demo / 'extract', out / 'warm', a, start)}
    loss = {k: [m['loss'] for m in read_metrics(p.parent) if 'loss' in m] for k, p in d.items() if p.parent.parent == out}
    files = f"{REAL / 'sharegpt-prompts-heldout.jsonl'},{REAL / 'humaneval-prompts.jsonl'}"
    probe = TauProbe(target, files, a.eval_prompts, a.eval_max_new_tokens)
    tn, _ = probe(NgramDrafter())
    rows = {}
    for name, path in d.items():
        t, r = probe(load_drafter(path, probe._load()))
        rows[name] = dict(tau=t, by_file={Path(f).name: x['tau'] for f, x in r.items()}, lossless=all(x['lossless'] for x in r.values()))
        print(name, rows[name], flush=True)
    res = dict(steps=a.steps, lr=a.lr, ngram=tn, tau=rows, loss_first_last={k: (v[0], v[-1]) for k, v in loss.items() if v},
               eval=dict(files=files, prompts=a.eval_prompts, max_new_tokens=a.eval_max_new_tokens))
    (out / 'warm_start.json').write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--demo', default=str(ROOT / 'runs' / 'real-demo')); ap.add_argument('--out', default=str(ROOT / 'runs' / 'warm-start'))
    ap.add_argument('--start', default=str(ROOT / 'runs' / 'data-curve' / 'n264' / 'drafter'))
    ap.add_argument('--steps', type=int, default=60); ap.add_argument('--lr', type=float, default=2e-3)
    ap.add_argument('--eval-prompts', type=int, default=8); ap.add_argument('--eval-max-new-tokens', type=int, default=128)
    main(ap.parse_args())
