"""Training benchmark: the trainer against the limits it cannot beat, on the same batches, in one run.

    .venv/bin/python bench/train.py [--steps 60] [--out runs/bench] [--samples 1200] [--threads 1] [--profile]

`--profile` adds the torch profiler's table of the bare step (operators by self CPU time, 20 steps) to the output.

Each method runs in a process of its own, with `--threads` torch threads per process (the online pipeline's ranks get
the same), over the same token-budget batches of the embedded corpus, the embedded target and a 1-layer drafter:
- bare:    the drafter's own loop: forward, backward, clip, optimizer step, on batches already in memory (the taps
           computed beforehand). Nothing else: the drafter side's limit.
- bare-compile: the same loop with the drafter compiled (`torch.compile`, dynamic shapes), warm-up steps excluded.
- target:  the target's forward up to the last tap (`capture`) on the same batches: the target side's limit, per rank.
- offline: `dflash_train --extracted` from an extraction of the same samples (shards read by the prefetch thread, each
           checked against its sha256 once, metrics written, no checkpoints).
- offline-noverify: the same without the checksum checks, to show what they cost.
- online-1+1: `dflash_train` with 1 target rank feeding 1 drafter rank through the HS queue.
Ratios: offline / bare, and online / min(target rate, bare rate) (the pipeline cannot beat its slower side).
Results go to OUT/train.json and are printed as a table.
"""
import argparse, json, os, platform, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def batches(a):
    "The benchmark's data: the first `--samples` of the prepared train split, and the plan every method runs."
    import numpy as np
    from dflash.core import TINY_TARGET, TRAIN_DATA
    from dflash.data import TokenizedDataset, prepared
    from dflash.batching import Plan
    ds = TokenizedDataset.load(prepared(TRAIN_DATA, TINY_TARGET, Path(a.out) / 'work'))
    L = np.asarray(ds.lengths[:a.samples])
    return ds, Plan(L, a.budget, 64, 1, 0, max_steps=a.steps + a.warmup)


def run_inner(method, a):
    "One method, in this process: tokens/s over the steps after the warm-up ones."
    import numpy as np, torch
    torch.set_num_threads(a.threads)
    from dflash.core import TINY_TARGET
    from dflash.taps import load_target, capture, pad_batch, load_target_io
    from dflash.feed import collate
    from dflash.model import DFlashDraftModel, drafter_config
    from dflash.blocks import anchor_generator
    from dflash.optim import lr_factor
    ds, plan = batches(a)
    target = load_target(TINY_TARGET, device='cpu')
    items = []
    for p in range(plan.total_micro):
        rows = [ds[int(j)] for j in plan.batch(0, p)]
        ids, mask, index = pad_batch([r['input_ids'] for r in rows])
        if method == 'target': items.append((ids, mask, index, int(mask.sum()))); continue
        hs = capture(target, ids, mask, [4], index)
        items.append((p, *collate(hs, np.concatenate([r['input_ids'] for r in rows]), np.concatenate([r['loss_mask'] for r in rows]),
                                  [len(r['input_ids']) for r in rows]), int(mask.sum())))
    if method != 'target':
        import gc
        del target; gc.collect()            # the taps are computed: time the drafter alone, as a drafter rank runs
    def timed(fn):
        for it in items[:a.warmup]: fn(it)
        t0 = time.perf_counter()
        for it in items[a.warmup:]: fn(it)
        return sum(it[-1] for it in items[a.warmup:]) / (time.perf_counter() - t0)
    if method == 'target': return timed(lambda it: capture(target, it[0], it[1], [4], it[2]))
    torch.manual_seed(0)
    from dflash.taps import load_target_config
    d = DFlashDraftModel(drafter_config(load_target_config(TINY_TARGET), 1, 16, 3, [4]))
    emb, head = load_target_io(TINY_TARGET, torch.float32)
    d.attach_target(embed_tokens=emb, lm_head=head).train()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, plan.total_steps, 0.05, 0.1))
    if method == 'bare-compile': d.compile(dynamic=True)
    def step(it):
        p, hs, ids, lm, _ = it
        o = d(hs, ids, lm, num_anchors=a.anchors, generator=anchor_generator(0, 0, p))
        o.loss.backward(); torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0); opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    if method == 'profile':
        from torch.profiler import profile, ProfilerActivity
        for it in items[:a.warmup]: step(it)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for it in items[a.warmup:a.warmup + 20]: step(it)
        print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=18, max_name_column_width=40), file=sys.stderr)
        return 0.0
    return timed(step)


def trainer_rate(out):
    "Tokens/s of a trainer run from its metrics: the tokens trained after the first log interval (the warm-up steps) over the time they took."
    from dflash.core import read_metrics
    recs = [m for m in read_metrics(out) if 'loss' in m]
    return (recs[-1]['tokens'] - recs[0]['tokens']) / (recs[-1]['time'] - recs[0]['time']), recs[1:]


def run_trainer(method, a):
    out, work = Path(a.out) / method, Path(a.out) / 'work'
    shutil.rmtree(out, ignore_errors=True)
    common = ['--target', str(ROOT / 'data' / 'tiny-target'), '--out', str(out), '--num-layers', '1', '--layer-ids', '4', '--num-anchors', str(a.anchors),
              '--token-budget', str(a.budget), '--max-batch-size', '64', '--max-samples', str(a.samples), '--max-steps', str(a.steps + a.warmup),
              '--log-every', str(a.warmup), '--ckpt-every', '0', '--no-final-eval', '--no-progress', '--threads', str(a.threads), '--seed', '0']
    if method.startswith('offline'):
        x = work / 'x'
        if not (x / 'manifest.json').exists() or not json.loads((x / 'manifest.json').read_text()).get('complete'):
            subprocess.run([str(BIN / 'dflash_extract'), '--target', str(ROOT / 'data' / 'tiny-target'), '--data', str(work / 'dataset'), '--out', str(x),
                            '--layer-ids', '4', '--no-progress', '--overwrite'], check=True, capture_output=True)
        cmd = ['--extracted', str(x), '--drafters', '1']
    else: cmd = ['--data', str(work / 'dataset'), '--targets', '1', '--drafters', '1']
    env = {**os.environ, 'OMP_NUM_THREADS': str(a.threads)}
    if method == 'offline-noverify': cmd.append('--no-verify')
    t0 = time.time()
    r = subprocess.run([str(BIN / 'dflash_train'), *common, *cmd], capture_output=True, text=True, env=env)
    if r.returncode: sys.exit(f'{method} failed:\n{r.stderr[-3000:]}')
    rate, recs = trainer_rate(out)
    return rate, dict(q_hs=[m['q_hs'] for m in recs], drafter_idle=[m['drafter_idle'] for m in recs],
                      target_idle=[m.get('target_idle') for m in recs], wall_s=time.time() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--steps', type=int, default=60, help='measured steps (after the warm-up ones)')
    p.add_argument('--warmup', type=int, default=5)
    p.add_argument('--samples', type=int, default=1200)
    p.add_argument('--budget', type=int, default=2048)
    p.add_argument('--anchors', type=int, default=16)
    p.add_argument('--threads', type=int, default=1, help='torch threads per process (and per rank)')
    p.add_argument('--methods', default='bare,bare-compile,target,offline,offline-noverify,online-1+1')
    p.add_argument('--out', default=str(ROOT / 'runs' / 'bench'))
    p.add_argument('--profile', action='store_true', help="print the profiler's table of the bare step")
    p.add_argument('--method', help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.method:
        print('RESULT ' + json.dumps(run_inner(a.method, a)), flush=True); return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    batches(a)                                   # prepares the dataset once, before anything is timed
    res, extra = {}, {}
    for m in a.methods.split(',') + (['profile'] if a.profile else []):
        if m in ('bare', 'bare-compile', 'target', 'profile'):
            r = subprocess.run([sys.executable, __file__, '--method', m, *sys.argv[1:]], capture_output=True, text=True,
                               env={**os.environ, 'OMP_NUM_THREADS': str(a.threads)})
            line = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
            if r.returncode or not line: sys.exit(f'{m} failed:\n{r.stderr[-3000:]}')
            if m == 'profile':
                extra['profile'] = r.stderr[r.stderr.index('---'):] if '---' in r.stderr else r.stderr
                print(extra['profile'], flush=True); continue
            res[m] = json.loads(line[0][7:])
        else: res[m], extra[m] = run_trainer(m, a)
        print(f'{m:18s} {res[m]:8.0f} tokens/s', flush=True)
    ratios = {}
    if 'offline' in res and 'bare' in res: ratios['offline / bare'] = res['offline'] / res['bare']
    if 'bare-compile' in res and 'bare' in res: ratios['bare-compile / bare'] = res['bare-compile'] / res['bare']
    if 'offline-noverify' in res and 'offline' in res: ratios['offline / offline-noverify (checksum cost)'] = res['offline'] / res['offline-noverify']
    if 'online-1+1' in res and 'bare' in res and 'target' in res:
        ratios['online-1+1 / min(target, bare)'] = res['online-1+1'] / min(res['target'], res['bare'])
    for k, v in ratios.items(): print(f'{k:44s} {v:.3f}')
    import torch
    env = dict(python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(), threads=a.threads, load_avg=os.getloadavg())
    (Path(a.out) / 'train.json').write_text(json.dumps(dict(results=res, ratios=ratios, details=extra, env=env, command=' '.join(sys.argv)), indent=1))
    print(f"wrote {Path(a.out) / 'train.json'}; machine: {env}")


if __name__ == '__main__':
    main()
