"""Follow one drafter rank's set-up through the package: every call into a `dflash` module from the rank's entry (`run_rank`) until
its training loop starts, as the sequence of modules the calls pass through. Prints the modules in the order first entered, how
often the sequence comes back to a module it had left (and how often by climbing back up the import order), and the calls that
load the target's config. Run from the repository root: `python tools/trace_setup.py` (a 2-layer hybrid target, 24 conversations,
an offline DFlash run with a training vocabulary, on the CPU; a minute)."""
import sys, tempfile, json
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))
from test_layout import ORDER


class Started(Exception): pass


def trace(run_rank, arg):
    "The sequence of dflash modules entered by calls while `run_rank(arg)` sets a drafter rank up, and the config loads."
    import dflash.trainer as T
    seq, loads = [], []
    def prof(frame, event, _):
        if event != 'call': return
        mod = frame.f_globals.get('__name__', '')
        if not mod.startswith('dflash.') or mod == 'dflash._modidx': return
        m = mod.split('.', 1)[1]
        if not seq or seq[-1] != m: seq.append(m)
        if frame.f_code.co_name == 'load_target_config': loads.append(frame.f_back.f_globals.get('__name__', '') + '.' + frame.f_back.f_code.co_name)
    def stop(self, *a, **k): raise Started()
    T.Trainer.run = stop
    sys.setprofile(prof)
    try: run_rank(arg)
    except Started: pass
    finally: sys.setprofile(None)
    return seq, loads


def main():
    from transformers import AutoTokenizer, AutoModelForCausalLM
    from dflash.core import TINY_TARGET, TRAIN_DATA
    from dflash.tiny_target import target_config
    from dflash.extract import extract
    from dflash.recipe import TrainConfig
    from dflash.train import run_rank
    tmp = Path(tempfile.mkdtemp())
    tok = AutoTokenizer.from_pretrained(TINY_TARGET); torch.manual_seed(0)
    AutoModelForCausalLM.from_config(target_config(tok, hidden=64, layers=4)).save_pretrained(tmp / 'target'); tok.save_pretrained(tmp / 'target')
    (tmp / 'few.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:24]))
    x = extract(target=str(tmp / 'target'), data=str(tmp / 'few.jsonl'), out=str(tmp / 'x'), layer_ids=[1, 2], token_budget=512, progress=False)
    cfg = TrainConfig(target=str(tmp / 'target'), extracted=x['out'], out=str(tmp / 'run'), num_layers=1, max_steps=2, train_vocab=64,
                      final_eval=False, progress=False, val_data='none')
    try:
        from dflash.resolve import resolve
        arg = resolve(cfg)
    except ImportError:                                          # the layout before the run was resolved once
        from dflash.train import prepare_job
        arg = prepare_job(cfg)
    seq, loads = trace(run_rank, arg)
    rank = {m: i for i, m in enumerate(ORDER)}
    again = [(a, b) for i, (a, b) in enumerate(zip(seq, seq[1:])) if b in seq[:i + 1]]
    up = [(a, b) for a, b in again if rank.get(b, -1) > rank.get(a, -1)]
    r = dict(modules=list(dict.fromkeys(seq)), entered_again=len(again), climbing_up=len(up), config_loads=loads, sequence=seq)
    print(f"{len(r['modules'])} modules, entered again {r['entered_again']} times ({r['climbing_up']} climbing back up the import order), "
          f"the target's config loaded {len(loads)} times ({', '.join(loads) or 'never'})\n" + ' -> '.join(seq))
    print('TRACE ' + json.dumps(r))


if __name__ == '__main__': main()
