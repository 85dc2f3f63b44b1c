"""Do sliding windows cost acceptance? tau of drafters trained with and without a window, on contexts longer than it.

Trains two 2-layer drafters for the embedded target with the demo's other settings: full + full, and sliding + full
(the published layout in small: every layer sliding but the last) with a window of 16 tokens, far shorter than the
evaluation contexts (prompts of 14-41 tokens, then 64 new ones). Then measures, in one process on the same prompts,
both drafters and the windowed one forced back to full attention (its config edited, the weights unchanged).

    python tools/window_tau.py            # ~12 min on 2 CPU cores
"""
import argparse, json, os, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LAYOUTS = {'full': 'full_attention,full_attention', 'sliding': 'sliding_attention,full_attention'}


def train(out, layout, a):
    if (out / 'drafter' / 'model.safetensors').exists(): return out / 'drafter'
    cmd = [BIN / 'dflash_train', '--out', out, '--num-layers', 2, '--layer-types', LAYOUTS[layout], '--sliding-window', a.window,
           '--no-final-eval', '--no-progress', '--log-every', 50, '--overwrite', '--epochs', a.epochs]
    print('$', ' '.join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, env={**os.environ, 'HF_HUB_OFFLINE': '1'}, stdout=subprocess.DEVNULL)
    return out / 'drafter'


def forced_full(src, dst):
    "A copy of the drafter in `src` whose layers all attend fully: same weights, config edited."
    shutil.copytree(src, dst, dirs_exist_ok=True)
    c = json.loads((dst / 'config.json').read_text())
    c['layer_types'] = ['full_attention'] * len(c['layer_types'])
    for k in ('use_swa', 'swa_window_size', 'causal'): c['dflash_config'].pop(k, None)
    c['use_sliding_window'], c['sliding_window'] = False, None
    (dst / 'config.json').write_text(json.dumps(c, indent=2))
    return dst


def main(a):
    from dflash.core import TINY_TARGET, HELDOUT_DATA
    from dflash.evaluate import TauProbe, NgramDrafter, load_drafter
    out = Path(a.out)
    d = {k: train(out / k, k, a) for k in LAYOUTS}
    d['sliding, forced full'] = forced_full(d['sliding'], out / 'sliding-forced-full')
    probe = TauProbe(str(TINY_TARGET), str(HELDOUT_DATA), a.eval_prompts, a.eval_max_new_tokens)
    tn, _ = probe(NgramDrafter())
    rows = {}
    for name, path in d.items():
        t, r = probe(load_drafter(path, probe._load()))
        rows[name] = dict(tau=t, lossless=all(x['lossless'] for x in r.values()))
        print(name, rows[name], flush=True)
    res = dict(window=a.window, epochs=a.epochs, ngram=tn, tau=rows, eval=dict(prompts=a.eval_prompts, max_new_tokens=a.eval_max_new_tokens))
    (out / 'window.json').write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=str(ROOT / 'runs' / 'window')); ap.add_argument('--window', type=int, default=16)
    ap.add_argument('--epochs', type=float, default=2.0)
    ap.add_argument('--eval-prompts', type=int, default=16); ap.add_argument('--eval-max-new-tokens', type=int, default=64)
    main(ap.parse_args())
