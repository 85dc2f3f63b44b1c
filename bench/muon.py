"""The optimizer step of a real-size drafter on this CPU: AdamW, torch's Muon (Newton-Schulz in bf16) and ours (fp32).

    .venv/bin/python bench/muon.py [--target DIR] [--layers 2,5] [--reps 3] [--threads 1]

The drafter is the one `dflash_train` builds for `--target` (default: SmolLM2-135M-Instruct, converted by `dflash_gguf`,
else the embedded target), reading 5 taps. Each optimizer steps the same random gradients `--reps` times after one
warm-up step, in one process; the table gives the median seconds a step and the ratio to AdamW. Whether the CPU has bf16
matrix instructions (AVX512-BF16, AMX) decides torch's Muon: without them its bf16 iterations run far slower than fp32.
"""
import argparse, statistics, subprocess, sys, time
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parents[1]


def drafter(target, layers):
    from dflash.taps import load_target_config
    from dflash.model import DFlashDraftModel, drafter_config
    tcfg = load_target_config(target)
    L = tcfg.num_hidden_layers
    return DFlashDraftModel(drafter_config(tcfg, layers, 16, 0, [round(1 + i * (L - 4) / 4) for i in range(5)]))


def timed(make, model, reps):
    for p in model.parameters(): p.grad = torch.randn_like(p)
    opt = make(model)
    opt.step()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--target'); ap.add_argument('--layers', default='2,5')
    ap.add_argument('--reps', type=int, default=3); ap.add_argument('--threads', type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from dflash.core import TINY_TARGET
    from dflash.recipe import TrainConfig
    from dflash.optim import Muon, make_optimizer
    if a.target is None:
        r = subprocess.run([str(Path(sys.executable).parent / 'dflash_gguf')], capture_output=True, text=True)
        a.target = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else str(TINY_TARGET)
    flags = open('/proc/cpuinfo').read().split('flags')[1].splitlines()[0].split() if Path('/proc/cpuinfo').exists() else []
    print(f"target {a.target}; torch {torch.__version__}, {a.threads} thread(s); bf16 matrix instructions: "
          f"{', '.join(f for f in flags if 'bf16' in f or f.startswith('amx')) or 'none'}")
    cfg = lambda opt: TrainConfig(target=a.target, optimizer=opt, lr=8e-3, weight_decay=0.0)
    adamw = lambda m: make_optimizer(m, cfg('adamw'), lambda s: 1.0)[0]
    ours = lambda m: make_optimizer(m, cfg('muon'), lambda s: 1.0)[0]
    def torchs(m):
        opt = make_optimizer(m, cfg('muon'), lambda s: 1.0)[0]
        mu = opt.parts[0]
        opt.parts[0] = torch.optim.Muon(mu.param_groups[0]['params'], lr=8e-3, weight_decay=0.0, adjust_lr_fn='match_rms_adamw')
        return opt
    assert isinstance(ours(drafter(a.target, 1)).parts[0], Muon)
    print(f"{'layers':>6} {'params':>8} {'AdamW s':>8} {'Muon fp32 s':>12} {'x AdamW':>8} {'torch Muon bf16 s':>18} {'x AdamW':>8}")
    for n in map(int, a.layers.split(',')):
        m = drafter(a.target, n)
        t = {k: timed(f, m, a.reps) for k, f in dict(adamw=adamw, ours=ours, torch=torchs).items()}
        print(f"{n:6d} {sum(p.numel() for p in m.parameters()) / 1e6:7.1f}M {t['adamw']:8.3f} {t['ours']:12.3f} {t['ours'] / t['adamw']:8.1f} "
              f"{t['torch']:18.3f} {t['torch'] / t['adamw']:8.1f}", flush=True)


if __name__ == '__main__':
    main()
