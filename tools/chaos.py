"""Chaos run: interrupt extraction and training at random moments, resume, and check the result equals an uninterrupted run.

    .venv/bin/python tools/chaos.py --n 50 [--jobs extract,offline,online] [--seed 0] [--out runs/chaos]

Each trial picks a fault and a moment at random (seeded), runs the job as a user would (its console script, in a process
of its own), lets the fault hit, then runs the same command again, with `--resume` for training, until it succeeds.
Faults: SIGKILL and SIGTERM of the job's process; a full disk (every file capped at a random size, as a full disk stops
writes: RLIMIT_FSIZE); a rank dying (SIGKILL of one extraction worker, or of one rank of the online pipeline). Then:
- extraction: every sample's stored rows, ids and loss mask are bit-identical to the uninterrupted extraction's, and
  every shard's sha256 matches the manifest;
- training (offline from shards, online with 1 target and 1 drafter rank): the loss of every step, and the final
  drafter's weights, are bit-identical to the uninterrupted run's (CPU, float32).
Prints one line per trial and a summary, and writes OUT/chaos.json.
"""
import argparse, json, os, random, resource, shutil, signal, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}
TRAIN = ['--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--warmup', '0', '--min-lr-ratio', '0.1',
         '--weight-decay', '0', '--log-every', '1', '--ckpt-every', '2', '--keep', '2', '--no-final-eval', '--no-progress', '--max-steps', '14',
         '--dead-after-s', '5', '--no-servable']   # taps 1, 3 of a 4-layer target: llama.cpp's limit, not what chaos checks


def setup(work):
    "A random 4-layer hybrid target, 48 conversations prepared for it, and the uninterrupted reference runs."
    import torch
    from transformers import AutoTokenizer, AutoModelForCausalLM
    from dflash.core import TINY_TARGET, TRAIN_DATA
    from dflash.tiny_target import target_config
    work.mkdir(parents=True, exist_ok=True)
    if not (work / 'target' / 'config.json').exists():
        tok = AutoTokenizer.from_pretrained(TINY_TARGET); torch.manual_seed(0)
        AutoModelForCausalLM.from_config(target_config(tok, hidden=64, layers=4)).save_pretrained(work / 'target'); tok.save_pretrained(work / 'target')
        (work / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:48]))
        run(['dflash_prepare', '--data', work / 'rows.jsonl', '--target', work / 'target', '--out', work / 'data'], check=True)
    for name, cmd in references(work).items():
        if not (work / name / 'done').exists():
            shutil.rmtree(work / name, ignore_errors=True)
            run(cmd(work / name), check=True); (work / name / 'done').write_text('')


def extract_cmd(work, workers=1):
    return lambda out: ['dflash_extract', '--target', work / 'target', '--data', work / 'data', '--out', out, '--layer-ids', '1,3',
                        '--token-budget', '256', '--shard-mb', '0.02', '--no-progress', '--workers', workers, '--log-every', '0.2']

def offline_cmd(work):
    return lambda out: ['dflash_train', '--target', work / 'target', '--extracted', work / 'ref-x', '--out', out, '--drafters', '1', *TRAIN]

def online_cmd(work):
    return lambda out: ['dflash_train', '--target', work / 'target', '--data', work / 'data', '--out', out, '--targets', '1', '--drafters', '1',
                        '--layer-ids', '1,3', *TRAIN]

def references(work):
    return {'ref-x': extract_cmd(work), 'ref-offline': offline_cmd(work), 'ref-online': online_cmd(work)}


def run(cmd, check=False, preexec=None, timeout=600):
    r = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], capture_output=True, text=True, env=ENV, preexec_fn=preexec, timeout=timeout)
    if check and r.returncode: raise RuntimeError(f'{cmd[0]} failed:\n{r.stderr[-3000:]}')
    return r


def cap(nbytes):
    "A pre-exec function: files of this process and its children stop growing at `nbytes` (EFBIG), as on a full disk."
    def f():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return f


def children(pid):
    "Process ids whose parent is `pid`."
    kids = []
    for d in Path('/proc').iterdir():
        if d.name.isdigit():
            try: stat = (d / 'stat').read_text()
            except OSError: continue
            if int(stat.rsplit(')', 1)[1].split()[1]) == pid: kids.append(int(d.name))
    return kids

def pids(out, kind, launcher):
    "Process ids of the job's ranks (online) or worker processes (extraction), not the launcher's."
    if kind == 'online': return [int(p.read_text()) for p in sorted((out / 'logs').glob('rank-*.pid')) if p.read_text().strip()]
    return [c for c in children(launcher) if 'spawn_main' in Path(f'/proc/{c}/cmdline').read_text(errors='replace')]


def interrupt(job, cmd, out, rng):
    "Start `cmd`, hit it with a random fault at a random moment; returns (fault, when in s, how it ended)."
    faults = ['SIGKILL', 'SIGTERM', 'full disk'] + (['rank dies'] if job in ('extract', 'online') else [])
    fault = rng.choice(faults)
    if fault == 'full disk':
        limit = rng.choice([20, 40, 80, 160]) << 10
        r = run(cmd, preexec=cap(limit))
        return fault, f'files capped at {limit >> 10} KB', f'exit {r.returncode}'
    p = subprocess.Popen([str(BIN / cmd[0]), *map(str, cmd[1:])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                         start_new_session=True)
    when = rng.uniform(*{'extract': (0.5, 5.0), 'offline': (1.0, 8.0), 'online': (3.0, 13.0)}[job])
    t0 = time.time()
    while time.time() - t0 < when and p.poll() is None: time.sleep(0.05)
    if p.poll() is not None: return fault, f'{when:.1f}s', 'finished first'
    if fault == 'rank dies':
        ranks = pids(out, job, p.pid)
        try: os.kill(rng.choice(ranks), signal.SIGKILL) if ranks else os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: return fault, f'{when:.1f}s', 'finished first'    # the rank ended as it was chosen
    else: os.killpg(p.pid, getattr(signal, fault)) if fault == 'SIGKILL' else p.send_signal(signal.SIGTERM)
    try: p.wait(timeout=120)
    except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); p.wait()
    subprocess.run(['pkill', '-9', '-f', str(out)], capture_output=True)   # nothing of the interrupted run lives on
    return fault, f'{when:.1f}s', f'exit {p.returncode}'


def same_extraction(out, ref):
    "Every sample's rows, ids and mask bit-identical to the reference; every shard's sha256 right."
    import torch
    from dflash.extracted import ExtractedDataset
    a, b = ExtractedDataset(out, require_complete=True, verify=True), ExtractedDataset(ref)
    a.verify_all()
    if list(a.sample_ids) != list(b.sample_ids): return 'other samples'
    for i in range(len(b)):
        x, y = a[i], b[i]
        if not all(torch.equal(x[k], y[k]) for k in ('hidden_states', 'input_ids', 'loss_mask')): return f'sample {b.sample_ids[i]} differs'
    return None


def same_training(out, ref):
    "Every step's loss, and the final drafter's weights, bit-identical to the reference."
    from safetensors.torch import load_file
    from dflash.core import read_metrics
    losses = lambda d: {m['step']: m['loss'] for m in read_metrics(d) if 'loss' in m}
    la, lb = losses(out), losses(ref)
    if set(lb) - set(la): return f'steps {sorted(set(lb) - set(la))[:5]} missing'
    if bad := [s for s in lb if la[s] != lb[s]]: return f'loss differs at steps {bad[:5]}: {la[bad[0]]} vs {lb[bad[0]]}'
    wa, wb = load_file(out / 'drafter/model.safetensors'), load_file(ref / 'drafter/model.safetensors')
    if bad := [k for k in wb if not wa[k].equal(wb[k])]: return f'final weights differ: {bad[:3]}'
    return None


def trial(job, k, work, rng):
    out = work / 'trials' / f'{job}-{k}'
    shutil.rmtree(out, ignore_errors=True)
    cmd = {'extract': extract_cmd(work, rng.choice([1, 2])), 'offline': offline_cmd(work), 'online': online_cmd(work)}[job](out)
    fault, when, ended = interrupt(job, cmd, out, rng)
    resumes = 0
    for resumes in range(1, 6):
        r = run(cmd + (['--resume'] if job != 'extract' else []))
        if r.returncode == 0: break
    else: return dict(job=job, trial=k, fault=fault, when=when, ended=ended, resumes=resumes, ok=False, why=r.stderr.strip()[-300:])
    ref = work / {'extract': 'ref-x', 'offline': 'ref-offline', 'online': 'ref-online'}[job]
    why = same_extraction(out, ref) if job == 'extract' else same_training(out, ref)
    shutil.rmtree(out, ignore_errors=True)
    return dict(job=job, trial=k, fault=fault, when=when, ended=ended, resumes=resumes, ok=why is None, why=why)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--n', type=int, default=50, help='trials per job')
    p.add_argument('--jobs', default='extract,offline,online')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', default=str(ROOT / 'runs' / 'chaos'))
    a = p.parse_args(argv)
    work, rng, results = Path(a.out), random.Random(a.seed), []
    setup(work)
    t0 = time.time()
    for job in a.jobs.split(','):
        for k in range(a.n):
            r = trial(job, k, work, rng); results.append(r)
            print(f"{job:8s} {k:3d} {r['fault']:10s} at {r['when']:>22s} -> {r['ended']:14s} resumed x{r['resumes']}: "
                  + ('identical' if r['ok'] else f"DIFFERENT: {r['why']}"), flush=True)
    summary = {job: dict(trials=sum(r['job'] == job for r in results), identical=sum(r['ok'] for r in results if r['job'] == job),
                         faults={f: sum(r['fault'] == f for r in results if r['job'] == job) for f in sorted({r['fault'] for r in results})})
               for job in a.jobs.split(',')}
    (work / 'chaos.json').write_text(json.dumps(dict(summary=summary, trials=results, seconds=time.time() - t0, seed=a.seed), indent=1))
    for job, s in summary.items(): print(f"{job}: {s['identical']} of {s['trials']} identical after resume; faults {s['faults']}")
    return 0 if all(r['ok'] for r in results) else 1


if __name__ == '__main__':
    sys.exit(main())
