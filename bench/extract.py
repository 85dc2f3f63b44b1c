"""Extraction benchmark: naive vs ours vs the bare forward, on the embedded target and corpus.

    .venv/bin/python bench/extract.py [--samples 512] [--naive-samples 512] [--out runs/bench] [--methods ours,ours-final --repeat 3]

Each method runs in its own fresh process (so peak-memory figures are its own), over the same first N samples:

- naive:         one sample at a time, full forward with output_hidden_states=True (all layers, final norm, lm_head),
                 the tapped layers cut out of it, synchronous torch.save per sample.
- naive-batched: the naive recipe on our batches (output_hidden_states=True + lm_head, torch.save per batch):
                 shows what the memory goes to at equal batch size.
- ours:          dflash.extract.extract (taps on 5 layers, stop after the last tap, one host copy, background writer).
- ours-b512:     the same with token_budget=512 (2-20 samples a batch): memory at the scale of one sample.
- ours-final:    `ours` with final_hidden=True: the forward runs on to the final norm and its output (the state the head reads,
                 for distribution losses) is stored beside the taps; ours-final/ours is the cost of capturing it.
- bare-full:     the same batches through the full model forward (all layers, norm, lm_head); nothing kept or written.
- bare-taps:     the same batches through the forward up to the last tapped layer only; nothing kept or written.
- bare-final:    the same batches through the forward up to the final norm (what ours-final runs); nothing kept or written.

Peak memory is the process's max RSS above its level after loading the model and data (CPU), or
torch.cuda.max_memory_allocated above the loaded model (GPU). With --repeat N the methods run N times, taking turns (so a
shared machine's load falls on all of them alike), and each reports its run of median tokens/s. Results go to OUT/extract.json.
"""
import argparse, json, os, platform, resource, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ['naive', 'naive-batched', 'ours', 'ours-b512', 'ours-final', 'bare-full', 'bare-taps', 'bare-final']


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_method(method, a):
    "Run one method in this process; returns its figures."
    import numpy as np, torch
    from dflash.data import TokenizedDataset
    from dflash.batching import token_budget_batches, batch_stats, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE
    from dflash.taps import load_target, default_layer_ids, decoder_layers, tap_layers, pad_batch, StopForward
    from dflash.extract import extract
    cuda = torch.cuda.is_available() and not a.cpu
    dev = torch.device('cuda' if cuda else 'cpu')
    ds = TokenizedDataset.load(a.dataset)
    n = a.naive_samples if method == 'naive' else a.samples
    L = np.asarray(ds.lengths[:n])
    batches = token_budget_batches(L, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE)
    out = Path(a.out) / method
    shutil.rmtree(out, ignore_errors=True); out.mkdir(parents=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_target(a.target, dtype, dev)
    layer_ids = default_layer_ids(len(decoder_layers(model)))
    pad = model.config.pad_token_id or 0
    rows = [ds[i] for i in range(n)]
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    else: base = rss()
    t0 = time.perf_counter()
    eff = 1.0
    if method == 'naive':
        with torch.inference_mode():
            for i, r in enumerate(rows):
                x = torch.as_tensor(r['input_ids'].astype(np.int64))[None].to(dev)
                hs = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
                torch.save(dict(hidden_states=torch.cat([hs[k + 1][0] for k in layer_ids], -1).cpu(), input_ids=torch.as_tensor(r['input_ids']),
                                loss_mask=torch.as_tensor(r['loss_mask'])), out / f'{i}.pt')
    elif method.startswith('ours'):
        res = extract(a.target, a.dataset, out, max_samples=n, gpus=1 if cuda else 0, progress=False, log_every=1e9, model=model,
                      token_budget=512 if method == 'ours-b512' else 'auto', final_hidden=method == 'ours-final')
        eff, layer_ids = res['padding_efficiency'], res['layer_ids']
    else:
        eff = batch_stats(batches, L)['padding_efficiency']
        with torch.inference_mode():
            for b in batches:
                ids, mask, index = pad_batch([rows[i]['input_ids'] for i in b], pad)
                ids, mask = ids.to(dev), mask.to(dev)
                if method == 'bare-full': model(input_ids=ids, attention_mask=mask, use_cache=False)
                elif method in ('bare-taps', 'bare-final'):
                    with tap_layers(model, [max(layer_ids)], final=method == 'bare-final'):
                        try: model(input_ids=ids, attention_mask=mask, use_cache=False)
                        except StopForward: pass
                else:   # naive-batched
                    hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
                    sel = mask.flatten().bool()
                    torch.save(dict(hidden_states=torch.cat([hs[k + 1].flatten(0, 1)[sel] for k in layer_ids], -1).cpu(),
                                    input_ids=torch.cat([torch.as_tensor(rows[i]['input_ids']) for i in b])), out / f'{b[0]}.pt')
        if cuda: torch.cuda.synchronize()
    el = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else rss()) - base
    disk = sum(f.stat().st_size for f in out.rglob('*') if f.is_file() and 'dataset' not in f.parts)
    return dict(method=method, samples=n, tokens=int(L.sum()), seconds=el, samples_per_s=n / el, tokens_per_s=int(L.sum()) / el,
                peak_mem_bytes=int(peak), padding_efficiency=eff, layer_ids=layer_ids,
                disk_bytes=disk if method in ('naive', 'naive-batched', 'ours', 'ours-b512', 'ours-final') else 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--target', default=str(ROOT / 'data' / 'tiny-target'))
    p.add_argument('--data', default=str(ROOT / 'data' / 'sharegpt-train.jsonl'))
    p.add_argument('--samples', type=int, default=512)
    p.add_argument('--naive-samples', type=int, default=None, help='samples for the naive method (default: --samples)')
    p.add_argument('--methods', default=','.join(METHODS))
    p.add_argument('--repeat', type=int, default=1, help='runs of each method, taking turns; each reports its run of median tokens/s')
    p.add_argument('--out', default=str(ROOT / 'runs' / 'bench'))
    p.add_argument('--cpu', action='store_true', help='stay on CPU even with a GPU')
    p.add_argument('--omp-wait-policy', default='PASSIVE', help="OMP_WAIT_POLICY for the measured processes ('' leaves it unset): "
                   "PASSIVE keeps OpenMP threads from spinning, which on a CPU shared with other jobs costs up to 10x")
    p.add_argument('--method', help=argparse.SUPPRESS)
    p.add_argument('--dataset', help=argparse.SUPPRESS)
    a = p.parse_args()
    a.naive_samples = a.naive_samples or a.samples
    if a.method:   # child process
        print('RESULT ' + json.dumps(run_method(a.method, a)), flush=True); return
    import numpy as np
    from dflash.data import prepared
    from dflash.data import TokenizedDataset
    from dflash.batching import token_budget_batches, batch_stats, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE
    Path(a.out).mkdir(parents=True, exist_ok=True)
    a.dataset = str(prepared(a.data, a.target, a.out))
    L = TokenizedDataset.load(a.dataset).lengths
    full = batch_stats(token_budget_batches(L, DEFAULT_TOKEN_BUDGET, DEFAULT_MAX_BATCH_SIZE), L)['padding_efficiency']
    runs = {}
    for k in range(a.repeat):
        for m in a.methods.split(','):
            cmd = [sys.executable, __file__, '--method', m, '--dataset', a.dataset, '--target', a.target, '--samples', str(a.samples),
                   '--naive-samples', str(a.naive_samples), '--out', a.out] + (['--cpu'] if a.cpu else [])
            env = {**os.environ, **({'OMP_WAIT_POLICY': a.omp_wait_policy} if a.omp_wait_policy else {})}
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
            if r.returncode or not line: sys.exit(f'{m} failed:\n{r.stderr[-3000:]}')
            x = json.loads(line[0][7:]); runs.setdefault(m, []).append(x)
            print(f"{m:14s} {x['samples']:5d} samples {x['seconds']:7.1f}s  {x['samples_per_s']:7.1f} samples/s  {x['tokens_per_s']:8.0f} tokens/s  "
                  f"peak +{x['peak_mem_bytes'] / 2**20:7.1f} MiB  padding eff {x['padding_efficiency']:.3f}" + (f'  (run {k + 1})' if a.repeat > 1 else ''), flush=True)
    results = {}
    for m, xs in runs.items():
        results[m] = sorted(xs, key=lambda x: x['tokens_per_s'])[(len(xs) - 1) // 2]
        if len(xs) > 1: results[m]['runs_tokens_per_s'] = [x['tokens_per_s'] for x in xs]
    ratios = {}
    if 'ours' in results:
        o = results['ours']
        for m in ('naive', 'bare-full', 'bare-taps', 'naive-batched'):
            if m in results:
                ratios[f'ours/{m} tokens_per_s'] = o['tokens_per_s'] / results[m]['tokens_per_s']
                ratios[f'ours/{m} peak_mem'] = o['peak_mem_bytes'] / max(1, results[m]['peak_mem_bytes'])
    if 'ours-final' in results and 'ours' in results:   # the cost of capturing the final state as well
        o, f = results['ours'], results['ours-final']
        ratios['ours-final/ours tokens_per_s'] = f['tokens_per_s'] / o['tokens_per_s']
        ratios['ours-final/ours peak_mem'] = f['peak_mem_bytes'] / max(1, o['peak_mem_bytes'])
        ratios['ours-final/ours disk_bytes'] = f['disk_bytes'] / max(1, o['disk_bytes'])
    if 'bare-final' in results and 'bare-taps' in results:   # the forward's share of that cost
        ratios['bare-final/bare-taps tokens_per_s'] = results['bare-final']['tokens_per_s'] / results['bare-taps']['tokens_per_s']
    if 'ours-b512' in results and 'naive' in results:
        o, nv = results['ours-b512'], results['naive']
        ratios['ours-b512/naive tokens_per_s'] = o['tokens_per_s'] / nv['tokens_per_s']
        ratios['ours-b512/naive peak_mem'] = o['peak_mem_bytes'] / max(1, nv['peak_mem_bytes'])
    for k, v in ratios.items(): print(f'{k:34s} {v:.3f}')
    print(f'padding efficiency of the default budget ({DEFAULT_TOKEN_BUDGET}) on all {len(L)} samples: {full:.3f}')
    import torch
    env = dict(python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(), threads=torch.get_num_threads(),
               omp_wait_policy=a.omp_wait_policy or os.environ.get('OMP_WAIT_POLICY'),
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else None, load_avg=os.getloadavg())
    doc = dict(env=env, results=results, ratios=ratios, padding_efficiency_all_samples=full, command=' '.join(sys.argv))
    (Path(a.out) / 'extract.json').write_text(json.dumps(doc, indent=1))
    print(f"wrote {Path(a.out) / 'extract.json'}; machine: {env}")


if __name__ == '__main__':
    main()
