"""How much data a drafter needs: tau against the number of training conversations, at equal epochs, on the real target.

Trains one drafter per prefix of the real demo's extraction (`dflash_train --max-samples N`, the demo's other settings),
then measures every drafter in one process on the same prompts (the target's own decodes run once), and plots tau
against N beside the n-gram baseline. Run `make real-demo` first.

    python tools/data_curve.py --sizes 125,250,500 --with runs/real-demo/train/drafter:1000
"""
import argparse, json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
from real_demo import BIN, REAL  # noqa: E402  the same files and programs as the demo


def train(target, extracted, out, n, a):
    if (out / 'drafter' / 'model.safetensors').exists(): return out / 'drafter'
    cmd = [BIN / 'dflash_train', '--target', target, '--extracted', extracted, '--out', out, '--drafters', 1, '--max-samples', n,
           '--num-anchors', a.anchors, '--token-budget', a.token_budget, '--epochs', a.epochs, '--lr', a.lr, '--warmup', 0.05,
           '--min-lr-ratio', 0.1, '--no-final-eval', '--no-progress', '--log-every', 50, '--overwrite']
    print('$', ' '.join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, env={**os.environ, 'HF_HUB_OFFLINE': '1'}, stdout=subprocess.DEVNULL)
    return out / 'drafter'


def plot(res, path):
    "tau against the number of conversations, beside the n-gram baseline, to `path`."
    import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt
    rows, tn = {int(k): v for k, v in res['points'].items()}, res['ngram']
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ns = sorted(rows)
    ax.plot(ns, [rows[n]['tau'] for n in ns], 'o-', label='DFlash drafter')
    ax.axhline(tn, color='C3', ls='--', label=f'n-gram prompt lookup ({tn:.2f})')
    ax.set(xscale='log', xlabel='training conversations (target-regenerated ShareGPT prompts)', ylabel='tau',
           title=f"SmolLM2-135M-Instruct: tau against data ({res['settings']['epochs']} epochs each)")
    ax.minorticks_off(); ax.set_xticks(ns, [str(n) for n in ns]); ax.legend(); fig.tight_layout(); fig.savefig(path, dpi=100)


def main(a):
    if a.replot: return plot(json.loads((Path(a.out) / 'curve.json').read_text()), a.plot)
    import torch
    from dflash.evaluate import TauProbe, NgramDrafter, load_drafter
    out, demo = Path(a.out), Path(a.demo)
    target = json.loads((demo / 'extract' / 'manifest.json').read_text())['target']
    drafters = {int(n): train(target, demo / 'extract', out / f'n{n}', int(n), a) for n in a.sizes.split(',') if n}
    for spec in filter(None, a.extra.split(',')):
        path, n = spec.rsplit(':', 1); drafters[int(n)] = Path(path)
    files = f"{REAL / 'sharegpt-prompts-heldout.jsonl'},{REAL / 'humaneval-prompts.jsonl'}"
    probe = TauProbe(target, files, a.eval_prompts, a.eval_max_new_tokens)
    tn, _ = probe(NgramDrafter())
    rows = {}
    for n in sorted(drafters):
        t, r = probe(load_drafter(drafters[n], probe._load()))
        rows[n] = dict(tau=t, by_file={Path(f).name: x['tau'] for f, x in r.items()}, lossless=all(x['lossless'] for x in r.values()))
        print(n, rows[n], flush=True)
    res = dict(ngram=tn, points=rows, eval=dict(files=files, prompts=a.eval_prompts, max_new_tokens=a.eval_max_new_tokens),
               settings=dict(epochs=a.epochs, anchors=a.anchors, token_budget=a.token_budget, lr=a.lr))
    (out / 'curve.json').write_text(json.dumps(res, indent=1))
    plot(res, a.plot)
    print(json.dumps(res, indent=1))


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--demo', default=str(ROOT / 'runs' / 'real-demo')); ap.add_argument('--out', default=str(ROOT / 'runs' / 'data-curve'))
    ap.add_argument('--sizes', default='125,250,500'); ap.add_argument('--with', dest='extra', default='', help='DIR:N, drafters trained elsewhere')
    ap.add_argument('--epochs', type=int, default=2); ap.add_argument('--anchors', type=int, default=16)
    ap.add_argument('--token-budget', type=int, default=2048); ap.add_argument('--lr', type=float, default=2e-3)
    ap.add_argument('--eval-prompts', type=int, default=8); ap.add_argument('--eval-max-new-tokens', type=int, default=128)
    ap.add_argument('--plot', default=str(ROOT / 'assets' / 'real-data-curve.png'))
    ap.add_argument('--replot', action='store_true', help='only redraw the plot from out/curve.json')
    main(ap.parse_args())
