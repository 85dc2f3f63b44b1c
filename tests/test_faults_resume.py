"""Faults at the edges of resumes and settings (issue 31): what a resume may change takes effect, what is set aside is never
deleted, the job knows what the user gave, and bad or inert settings are said at the start. Each case asserts the exit status,
the message, and that nothing earlier was changed or lost."""
import json, math, os, shutil, subprocess, sys
from dataclasses import fields
from pathlib import Path
import numpy as np, pytest, torch
from dflash.core import TRAIN_DATA, HELDOUT_DATA, TINY_TARGET, read_metrics, read_jsonl, job_parser, _kinds
from dflash.data import prepare_cli, PrepareConfig
from dflash.extract import extract, ExtractConfig
from dflash.evaluate import EvalConfig, evaluate_cli
from dflash.plan import PlanConfig
from dflash.regenerate import RegenerateConfig
from dflash.gguf import GGUFConfig
from dflash.recipe import TrainConfig
from dflash.extracted import ExtractedDataset
from dflash.checkpoint import RESUME_KEYS, SHAPE_KEYS, FIXED_KEYS, latest_checkpoint
from dflash.optim import lr_factor
from dflash.train import train_cli
from dflash.resolve import resolve
from test_faults import cli, fails, tree, kept
from test_faults_data import cli as run           # (exit status, stdout, stderr)

BIN = Path(sys.executable).parent
JOBS = [PrepareConfig, ExtractConfig, TrainConfig, EvalConfig, PlanConfig, RegenerateConfig, GGUFConfig]
BASE = ['--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--log-every', '1', '--no-final-eval',
        '--no-progress', '--warmup', '0', '--min-lr-ratio', '0.1', '--weight-decay', '0', '--ckpt-every', '2', '--keep', '5',
        '--layer-types', 'sliding', '--sliding-window', '8', '--loss', 'decay', '--no-servable']   # taps 1, 3 of 4 layers: llama.cpp's limit, not what these tests check


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target):
    """A random 4-layer hybrid target; 40 training conversations and their extraction (taps 1, 3); two held-out extractions
    (12 conversations each); a spare mask token id; a run of 4 steps whose step-4 checkpoint and drafter are removed, so it
    resumes from step 2 (`base`); and a run of 2 steps with held-out acceptance, to resume with more steps (`vbase`)."""
    d = tmp_path_factory.mktemp('faults-resume')
    save_target(make_target('qwen3_5'), d / 'target')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    held = open(HELDOUT_DATA).readlines()
    (d / 'held.jsonl').write_text(''.join(held[:12])); (d / 'held2.jsonl').write_text(''.join(held[12:24]))
    assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', d / 'target', '--out', d / 'data')[0] == 0
    extract(target=str(d / 'target'), data=str(d / 'data'), out=str(d / 'x'), layer_ids=[1, 3], token_budget=512, progress=False)
    for v in ('held', 'held2'):
        extract(target=str(d / 'target'), data=str(d / f'{v}.jsonl'), out=str(d / f'val-{v}'), layer_ids=[1, 3], token_budget=512, progress=False)
    seen = set(ExtractedDataset(d / 'x').token_ids().tolist())
    (d / 'spare').write_text(str(next(i for i in range(4, 2048) if i not in seen)))   # a mask token id the data never holds
    assert cli(train_cli, '--target', d / 'target', '--extracted', d / 'x', '--out', d / 'base', *BASE, '--max-steps', '4')[0] == 0
    shutil.rmtree(d / 'base' / 'checkpoints' / 'step-4'); shutil.rmtree(d / 'base' / 'drafter'); (d / 'base' / 'result.json').unlink()
    assert cli(train_cli, '--target', d / 'target', '--extracted', d / 'x', '--out', d / 'vbase', *BASE, '--max-steps', '2',
               '--val-extracted', d / 'val-held', '--eval-every', '2', '--val-samples', '4')[0] == 0      # its kept best: step 2's
    return d


def resumed(w, tmp_path, *args, base='base'):
    "A copy of the run `base` resumed from step 2 with `args`: `(exit status, stdout, stderr, its out)`."
    out = tmp_path / 'run'; shutil.copytree(w / base, out)
    code, so, se = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out, '--resume', *args)
    return code, so, se, out


def seen(out):
    "What a run did after its resume: the losses and lrs of its steps, and its published drafter's config."
    m = [r for r in read_metrics(out) if 'loss' in r]
    c = json.loads((out / 'drafter' / 'config.json').read_text())
    return dict(loss=[r['loss'] for r in m if r['step'] > 2], lr=[r['lr'] for r in m if r['step'] > 2],
                config={k: v for k, v in c.items() if k not in ('_name_or_path',)})


# Every setting a resume may change: (the change, what it needs besides to have an effect). A new resume setting must be added here.
CHANGES = {'block_size': (['--block-size', '8'], []), 'mask_token_id': (['--mask-token-id', 'SPARE'], []),
           'layer_types': (['--layer-types', 'full'], []), 'sliding_window': (['--sliding-window', '2'], []),
           'is_causal': (['--no-is-causal'], []), 'num_anchors': (['--num-anchors', '4'], []), 'clip': (['--clip', '0.01'], []),
           'loss': (['--loss', 'dpace'], []), 'dpace_alpha': (['--dpace-alpha', '0.9'], ['--loss', 'dpace']),
           'selector_alpha': (['--selector-alpha', '0.1'], None), 'loss_terms': (['--loss-terms', 'ce:0.5'], []), 'train_vocab': (['--train-vocab', '64'], []),
           'train_vocab_tail': (['--train-vocab-tail', '16'], ['--train-vocab', '64']), 'precondition': (['--precondition'], []),
           'token_budget': (['--token-budget', '256'], []), 'max_batch_size': (['--max-batch-size', '2'], []),
           'max_samples': (['--max-samples', '20'], []), 'epochs': (['--epochs', '1'], None), 'max_steps': (['--max-steps', '6'], []),
           'grad_accum': (['--grad-accum', '2'], []), 'seed': (['--seed', '1'], []), 'lr': (['--lr', '1e-3'], []),
           'min_lr_ratio': (['--min-lr-ratio', '0.5'], []), 'warmup': (['--warmup', '3'], []), 'weight_decay': (['--weight-decay', '0.5'], []),
           'optimizer': (['--optimizer', 'muon'], []), 'muon_ns_steps': (['--muon-ns-steps', '1'], ['--optimizer', 'muon']), 'target': (None, None),
           'val_data': (None, None), 'val_extracted': (['--val-extracted', 'VAL2'], 'vbase'), 'val_samples': (['--val-samples', '8'], 'vbase'),
           'val_anchors': (['--val-anchors', '4'], 'vbase'), 'val_tree_budgets': (['--val-tree-budgets', '4'], 'vbase'), 'engine_profile': (['--engine-profile', 'gpu'], 'vbase'),
           'best_by': (None, None)}
ELSEWHERE = {'selector_alpha': 'test_selector_alpha_change_takes_effect', 'epochs': 'test_epochs_change_takes_effect',
             'target': 'test_a_moved_target_resumes', 'val_data': 'test_another_val_data_on_resume_sets_the_old_extraction_aside',
             'best_by': 'test_best_by_change_takes_effect'}


def test_every_resume_setting_is_tested():
    assert set(CHANGES) == set(RESUME_KEYS) and all(f'def {t}(' in Path(__file__).read_text() for t in ELSEWHERE.values())


def _change(w, key):
    args, pre = CHANGES[key]
    return [(w / 'spare').read_text() if a == 'SPARE' else w / 'val-held2' if a == 'VAL2' else a for a in args], pre


@pytest.mark.parametrize('key', [k for k in CHANGES if k not in ELSEWHERE and CHANGES[k][1] != 'vbase'])
def test_a_resume_change_is_refused_unless_named_then_takes_effect(w, tmp_path, key):
    "Refused without resume_changes (nothing in out changed); named, the resumed steps differ from a plain resume's (with what it needs)."
    args, pre = _change(w, key)
    before = tree(w / 'base')
    code, _, err, out = resumed(w, tmp_path / 'refused', *pre, *args)
    assert code == 1 and f"resume_changes='" in err and key in err.splitlines()[0], err[-2000:]
    kept(before, tmp_path / 'refused' / 'run'); assert tree(tmp_path / 'refused' / 'run') == before
    names = ','.join(dict.fromkeys([key, *[a[2:].replace('-', '_') for a in pre if a.startswith('--')]]))
    ref = resumed(w, tmp_path / 'ref', *pre, *(['--resume-changes', names] if pre else []))
    got = resumed(w, tmp_path / 'got', *pre, *args, '--resume-changes', names)
    assert ref[0] == 0 and got[0] == 0, (ref[2] + got[2])[-3000:]
    a, b = seen(ref[3]), seen(got[3])
    assert a != b, f'{key}: the resumed run is the same with and without the change'
    ev = next(r for r in read_metrics(got[3]) if r.get('event') == 'resume')
    assert key in ev['changed'] and ev['step'] == 2


def test_lr_change_is_the_next_steps_learning_rate(w, tmp_path):
    "Case 1: the logged lr of the resumed steps follows the new peak, not the checkpoint's schedule."
    code, _, err, out = resumed(w, tmp_path, '--lr', '1e-3', '--resume-changes', 'lr')
    assert code == 0, err[-2000:]
    lrs = {r['step']: r['lr'] for r in read_metrics(out) if 'lr' in r}
    assert all(math.isclose(lrs[s], 1e-3 * lr_factor(s, 4, 0, 0.1), rel_tol=1e-12) for s in (3, 4))   # lr after step s: of step s + 1
    assert json.loads((out / 'config.json').read_text())['config']['lr'] == 1e-3


@pytest.mark.parametrize('key', [k for k in CHANGES if CHANGES[k][1] == 'vbase'])
def test_a_validation_change_measures_the_kept_best_again(w, tmp_path, key):
    "Case 6: refused unless named (nothing changed); named, the kept best is measured on the new split before anything is compared with it."
    args, _ = _change(w, key)
    args += ['--max-steps', '4']
    before = tree(w / 'vbase')
    code, _, err, out = resumed(w, tmp_path / 'no', *args, base='vbase')
    assert code == 1 and "resume_changes='max_steps," + key + "'" in err, err[-2000:]
    assert tree(out) == before
    code, so, err, out = resumed(w, tmp_path / 'yes', *args, '--resume-changes', f'{key},max_steps', base='vbase')
    assert code == 0, err[-2000:]
    vals = [r for r in read_metrics(out) if 'val_tau' in r]
    again = next(r for r in vals if r['step'] == 4)['best_remeasured']
    best = json.loads((out / 'checkpoints' / 'best' / 'BEST.json').read_text())
    first = json.loads((w / 'vbase' / 'checkpoints' / 'best' / 'BEST.json').read_text())
    assert again['step'] == 2 and again['before'] == first['val_tau'] and 'measured again on the new split' in so
    assert best['step'] == 4 or best.get('remeasured_from', {}).get('val_tau') == first['val_tau']



def test_best_by_change_takes_effect(w, tmp_path):
    """The figure that picks the best, changed on resume: refused unless named; a budget the run does not read is refused before
    anything changes; named, the next evaluations compare by the tree's figure (the kept best's read when it was kept)."""
    from dflash.validate import better
    before = tree(w / 'vbase')
    code, _, err, out = resumed(w, tmp_path / 'no', '--best-by', 'val_tree_tau@64', '--max-steps', '4', base='vbase')
    assert code == 1 and "resume_changes='max_steps,best_by'" in err and tree(out) == before, err[-2000:]
    code, _, err, out = resumed(w, tmp_path / 'bad', '--best-by', 'val_tree_tau@32', '--max-steps', '4', '--resume-changes', 'best_by,max_steps', base='vbase')
    assert code == 1 and 'add 32 there' in err and tree(out) == before, err[-2000:]
    code, so, err, out = resumed(w, tmp_path / 'yes', '--best-by', 'val_tree_tau@64', '--max-steps', '4', '--resume-changes', 'best_by,max_steps',
                                 '--eval-every', '1', base='vbase')
    assert code == 0, err[-2000:]
    kept = json.loads((w / 'vbase' / 'checkpoints' / 'best' / 'BEST.json').read_text())
    assert '64' in kept['val_tree_tau']                                 # the first run read trees: nothing to measure again
    for r in [r for r in read_metrics(out) if 'val_tau' in r and r['step'] > 2]:
        assert 'best_remeasured' not in r and r['best'] == better(r, kept, 'val_tree_tau@64'), r
        if r['best']: kept = r
    assert json.loads((out / 'checkpoints' / 'best' / 'BEST.json').read_text())['step'] == kept['step']

def test_selector_alpha_change_takes_effect(w, tmp_path):
    "DFlash2's selector weight: a DFlash2 run resumed with another weight trains otherwise."
    out0 = tmp_path / 'd2'
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out0, *BASE, '--max-steps', '4', '--arch', 'dflash2')[0] == 0
    shutil.rmtree(out0 / 'checkpoints' / 'step-4'); shutil.rmtree(out0 / 'drafter')
    runs = {}
    for name, extra in (('ref', []), ('got', ['--selector-alpha', '0.1', '--resume-changes', 'selector_alpha'])):
        shutil.copytree(out0, tmp_path / name)
        assert run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / name, '--resume', *extra)[0] == 0
        runs[name] = seen(tmp_path / name)
    assert runs['ref']['loss'] != runs['got']['loss']


def test_epochs_change_takes_effect(w, tmp_path):
    "A run planned by epochs, resumed with more: the plan and its schedule span the new length."
    out0 = tmp_path / 'ep'
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out0, *BASE, '--epochs', '0.5')[0] == 0
    first = json.loads((out0 / 'run.json').read_text())['total_steps']
    shutil.rmtree(out0 / 'drafter')
    code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out0, '--resume', '--epochs', '1', '--resume-changes', 'epochs')
    assert code == 0, err[-2000:]
    run_json = json.loads((out0 / 'run.json').read_text())
    assert run_json['total_steps'] > first and max(r['step'] for r in read_metrics(out0) if 'loss' in r) == run_json['total_steps']


def test_a_moved_target_resumes(w, tmp_path):
    "Case 16: the same target in another folder (its config hash the same) is not a change: the run resumes and says the path moved."
    moved = tmp_path / 'elsewhere'; shutil.copytree(w / 'target', moved)
    out = tmp_path / 'run'; shutil.copytree(w / 'base', out)
    code, so, err = run(train_cli, '--target', moved, '--extracted', w / 'x', '--out', out, '--resume')
    assert code == 0 and f'the target moved ({w / "target"} -> {moved}); its config is the same' in so, err[-2000:]
    assert json.loads((out / 'config.json').read_text())['config']['target'] == str(moved)


def test_another_target_is_refused(w, tmp_path, make_target, save_target):
    other = save_target(make_target('qwen3_5', seed=1, rms_norm_eps=1e-5), tmp_path / 'other')
    out = tmp_path / 'run'; shutil.copytree(w / 'base', out); before = tree(out)
    code, _, err = run(train_cli, '--target', other, '--extracted', w / 'x', '--out', out, '--resume', '--resume-changes', 'target')
    assert code == 1 and ('trained for another target' in err or 'whose config differs' in err), err[-2000:]
    assert tree(out) == before


def test_another_val_data_on_resume_sets_the_old_extraction_aside(w, tmp_path):
    "Case 11: a run validated on a file, resumed on another: refused unless named; named, the old out/val is set aside (kept), the new one extracted."
    out = tmp_path / 'run'
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', out, *BASE, '--eval-every', '2']
    assert cli(train_cli, *args, '--max-steps', '2', '--val-data', w / 'held.jsonl')[0] == 0
    args += ['--max-steps', '4', '--val-data', w / 'held2.jsonl', '--resume']
    before = tree(out)
    code, _, err = run(train_cli, *args)
    assert code == 1 and "resume_changes='max_steps,val_data'" in err and 'overwrite=True sets it aside' not in err, err[-2000:]
    assert tree(out) == before
    code, _, err = run(train_cli, *args, '--overwrite')
    assert code == 1 and 'give one of them' in err and tree(out) == before
    code, so, err = run(train_cli, *args, '--resume-changes', 'val_data,max_steps')
    assert code == 0, err[-2000:]
    old = next(out.glob('previous-*/val'))
    assert json.loads((old / 'manifest.json').read_text())['dataset_sha256'] != json.loads((out / 'val' / 'manifest.json').read_text())['dataset_sha256']
    assert 'val_data changed' in so and next(r for r in read_metrics(out) if r.get('step') == 4 and 'val_tau' in r)['best_remeasured']


def test_optimizer_change_both_ways_starts_a_fresh_optimizer(w, tmp_path):
    "Case 2: following the refusal's advice works: AdamW -> Muon and back, each a fresh optimizer, said; the schedule goes on."
    code, so, err, out = resumed(w, tmp_path / 'a', '--optimizer', 'muon', '--resume-changes', 'optimizer')
    assert code == 0 and 'resume: optimizer adamw -> muon: a fresh muon optimizer' in so, err[-2000:]
    code, so, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out, '--resume', '--optimizer', 'adamw',
                        '--max-steps', '6', '--resume-changes', 'optimizer,max_steps')      # from the Muon run's step-4 checkpoint
    assert code == 0 and 'resume: optimizer muon -> adamw: a fresh adamw optimizer' in so, err[-2000:]
    assert [r['step'] for r in read_metrics(out) if 'loss' in r] == [1, 2, 3, 4, 5, 6]


def test_a_resume_without_settings_continues_the_same_run(w, tmp_path):
    "Every setting the user leaves unset is the checkpoint's: `--resume` alone goes on, bit for bit as an uninterrupted run."
    out = tmp_path / 'run'; shutil.copytree(w / 'base', out)
    code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out, '--resume')
    assert code == 0, err[-2000:]
    full = tmp_path / 'full'
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', full, *BASE, '--max-steps', '4')[0] == 0
    assert [r['loss'] for r in read_metrics(out) if 'loss' in r] == [r['loss'] for r in read_metrics(full) if 'loss' in r]
    saved = json.loads((out / 'config.json').read_text())
    assert saved['config']['layer_types'] == 'sliding_attention' and saved['origins']['num_anchors'] == "the checkpoint's"


def test_fixed_and_shape_settings_are_refused(w, tmp_path):
    for args, msg in ((['--init-from', w / 'base' / 'checkpoints' / 'step-2'], 'init_from is read when a run starts'),
                      (['--num-layers', '2', '--layer-types', 'full,full'], "the drafter's shape differs")):
        code, _, err, out = resumed(w, tmp_path / args[0][2:], *args, '--resume-changes', args[0][2:].replace('-', '_'))
        assert code == 1 and msg in err, err[-2000:]
        assert tree(out) == tree(w / 'base')


def test_two_resumes_from_one_checkpoint_keep_both_asides(w, tmp_path):
    "Case 3: each resume from step 2 sets the later best and metrics aside under a name of its own; nothing is deleted."
    out = tmp_path / 'run'
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', out, '--val-extracted', w / 'val-held', *BASE, '--max-steps', '4', '--eval-every', '3']
    assert cli(train_cli, *args)[0] == 0
    bests = []
    for k in range(2):
        shutil.rmtree(out / 'checkpoints' / 'step-4'); shutil.rmtree(out / 'drafter')
        bests.append((out / 'checkpoints' / 'best' / 'model.safetensors').read_bytes())
        assert run(train_cli, *args, '--resume')[0] == 0
    assert (out / 'checkpoints' / 'best.after-2' / 'model.safetensors').read_bytes() == bests[0]
    assert (out / 'checkpoints' / 'best.after-2.2' / 'model.safetensors').read_bytes() == bests[1]
    assert [r['step'] for r in read_jsonl(out / 'metrics.after-2.jsonl') if 'loss' in r] == [3, 4]
    assert [r['step'] for r in read_jsonl(out / 'metrics.after-2.2.jsonl') if 'loss' in r] == [3, 4]


def test_a_kept_best_that_is_not_whole_stops_the_resume_at_its_start(w, tmp_path):
    "Case 12: weights missing, or a BEST.json cut short: refused before any training, naming the file."
    for how in ('weights', 'json'):
        out = tmp_path / how; shutil.copytree(w / 'vbase', out)
        f = out / 'checkpoints' / 'best' / ('model.safetensors' if how == 'weights' else 'BEST.json')
        if how == 'weights': f.unlink()
        else: f.write_text(f.read_text()[:19])
        before = tree(out)
        code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out, '--resume')
        assert code == 1 and str(f) in err and ('is missing' if how == 'weights' else 'is not a best-drafter record') in err, err[-2000:]
        assert tree(out) == before


def test_the_user_given_set_is_known_for_every_parameter():
    "Case 4's mechanism: every parameter of every job given on the command line at its own default counts as given."
    for job in JOBS:
        p = job_parser(job, 'x')
        for f in fields(job):
            if f.default is None: continue
            a = vars(p.parse_args([f'--{f.name}' if f.default is True else f'--no-{f.name.replace("_", "-")}' if f.default is False
                                   else f'--{f.name}', *([] if isinstance(f.default, bool) else [str(f.default)])]))
            assert f.name in a, (job.__name__, f.name)
        assert set(vars(p.parse_args([]))) == {'debug'}


def test_init_from_a_dflash2_checkpoint_with_arch_dflash_is_refused(w, tmp_path):
    "Case 4: `--arch dflash` is given even though it is the default: against a DFlash2 checkpoint it is refused, not overridden."
    out0 = tmp_path / 'd2'
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out0, *BASE, '--max-steps', '2', '--arch', 'dflash2')[0] == 0
    err = fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'ft', '--init-from', out0 / 'drafter',
                '--arch', 'dflash', '--max-steps', '2', '--no-final-eval', msg="has arch='dflash2'; this run has arch='dflash'")
    assert not (tmp_path / 'ft' / 'checkpoints').exists()


def test_val_data_none_turns_validation_off_on_the_demo(tmp_path):
    "Case 4: `--val-data none` is off, not the default (the demo would validate on its held-out replies)."
    a = vars(job_parser(TrainConfig, 'x').parse_args(['--val-data', 'none', '--out', str(tmp_path / 'run')])); a.pop('debug')
    (tmp_path / 'few.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:8]))
    cfg = resolve(TrainConfig(**a, data=str(tmp_path / 'few.jsonl'))).config
    assert cfg.demo and cfg.val_data == 'none' and not cfg.validates and not (tmp_path / 'run' / 'val').exists()
    assert TrainConfig(data=str(tmp_path / 'few.jsonl')).validates                       # left unset, the demo validates


def test_dpace_alpha_zero_is_refused(w, tmp_path):
    "Case 5: at alpha 0 the weights are products of ~1/V confidences and nothing is learnt: refused when the options are read."
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', '--loss', 'dpace', '--dpace-alpha', '0',
          msg='dpace_alpha=0.0: must be > 0')
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('job', JOBS, ids=lambda j: j.__name__)
def test_every_float_parameter_is_checked_finite(job):
    "Case 13: every float parameter of every job refuses NaN and inf when it is built, naming the parameter."
    for f in fields(job):
        if float not in _kinds(f.type): continue
        for bad in (float('nan'), float('inf')):
            with pytest.raises(ValueError, match=f'{f.name}={bad!r}: must be a finite number'): job(**{f.name: bad})


def test_tiny_temperatures_are_refused():
    "Case 13: a positive temperature too small to divide by (1e-45) would end the run in NaN probabilities: refused at the start."
    for job, name in ((TrainConfig, 'eval_temperature'), (EvalConfig, 'temperature')):
        with pytest.raises(ValueError, match=f'{name}=1e-45: must be 0 or >= 0.001'): job(**{name: 1e-45})


def test_nan_options_fail_before_any_work(w, tmp_path):
    "Case 13, from the shell: NaN selector weight, D-PACE alpha, temperature and top-p stop the job before run.json or any result."
    for fn, args, name in ((train_cli, ['--selector-alpha', 'nan'], 'selector_alpha'), (train_cli, ['--dpace-alpha', 'nan'], 'dpace_alpha'),
                           (train_cli, ['--eval-temperature', 'nan'], 'eval_temperature'),
                           (evaluate_cli, ['--top-p', 'nan', '--temperature', '0.7'], 'top_p')):
        out = tmp_path / name
        fails(fn, '--target', w / 'target', '--out', out, *args, msg=f'{name}=nan: must be a finite number')
        assert not out.exists()


INERT = [(['--selector-alpha', '0.5'], "selector_alpha=0.5 has no effect: it is read only with arch='dflash2'"),
         (['--dpace-alpha', '0.3'], "dpace_alpha=0.3 has no effect: it is read only with loss='dpace', 'tree@N' or 'treegrad@N'"),
         (['--train-vocab-tail', '16'], 'train_vocab_tail=16 has no effect: it is read only with train_vocab'),
         (['--eval-top-p', '0.9'], 'eval_top_p=0.9 has no effect: it is read only with eval_temperature > 0'),
         (['--eval-top-k', '5'], 'eval_top_k=5 has no effect: it is read only with eval_temperature > 0'),
         (['--eval-every', '2'], 'eval_every=2 has no effect: it is read only with a validation split (val_data or val_extracted)')]


def test_inert_settings_are_each_warned_once(w, tmp_path):
    "Case 14: one warning per setting the run never reads, in stderr and config.json; the run goes on."
    args = [a for a, _ in INERT for a in a]
    code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *BASE, '--max-steps', '1', *args)
    assert code == 0, err[-2000:]
    for _, msg in INERT: assert err.count(f'warning: {msg}') == 1, (msg, err[-3000:])
    assert sorted(json.loads((tmp_path / 'run' / 'config.json').read_text())['warnings']) == sorted(m for _, m in INERT)
    code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'quiet', *BASE, '--max-steps', '1')
    assert code == 0 and 'warning:' not in err, err[-2000:]


def test_evaluate_sampling_settings_without_a_temperature_are_warned(w, tmp_path):
    e = EvalConfig(target=str(w / 'target'), top_p=0.9, top_k=5, out=str(tmp_path / 'ev'))
    assert e.warnings == ['top_p=0.9 has no effect: it is read only with temperature > 0', 'top_k=5 has no effect: it is read only with temperature > 0']


def test_max_samples_beyond_the_data_is_said(w, tmp_path):
    "Case 8: asking for 1000 samples of 40 trains on 40, and says so."
    code, _, err = run(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *BASE, '--max-steps', '1',
                       '--max-samples', '1000')
    assert code == 0 and f"warning: max_samples=1000: extracted: {w / 'x'} holds 40 samples: the run trains on all 40" in err, err[-2000:]


def test_validation_misuse_is_refused(w, tmp_path):
    "Case 9: the training extraction as the held-out split, the training file as val_data, and both splits at once: refused at the start."
    common = ['--target', w / 'target', *BASE, '--max-steps', '1']
    fails(train_cli, *common, '--extracted', w / 'x', '--out', tmp_path / 'a', '--val-extracted', w / 'x', msg='holds the training data')
    fails(train_cli, *common, '--data', w / 'rows.jsonl', '--out', tmp_path / 'b', '--val-data', w / 'rows.jsonl', msg='is the training data')
    fails(train_cli, *common, '--extracted', w / 'x', '--out', tmp_path / 'c', '--val-data', w / 'held.jsonl', '--val-extracted', w / 'val-held',
          msg='give one validation split, not both')
    fails(train_cli, *common, '--extracted', w / 'x', '--out', tmp_path / 'd', '--val-data', w / 'rows.jsonl', msg='holds the training data')
    for d in 'abc': assert not (tmp_path / d / 'checkpoints').exists()


def test_a_block_longer_than_every_sample_is_refused(w, tmp_path):
    "Case 15: a block of 1000 on samples of at most a few hundred tokens: refused, naming the longest sample."
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', '--block-size', '1000', '--no-final-eval', '--no-servable',
          msg='block_size=1000: the longest training sample has')
    assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_a_tracker_store_that_cannot_be_written_stops_the_job_at_its_start(w, tmp_path):
    "Case 17: TRACKIO_DIR that cannot be written (here under a file): exit 1 naming it, nothing trained."
    (tmp_path / 'a-file').write_text('')
    r = subprocess.run([str(BIN / 'dflash_train'), '--target', str(w / 'target'), '--extracted', str(w / 'x'), '--out', str(tmp_path / 'run'),
                        *BASE, '--max-steps', '2', '--report-to', 'trackio'], capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'TRACKIO_DIR': str(tmp_path / 'a-file' / 'trackio'), 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 1 and f"TRACKIO_DIR {tmp_path / 'a-file' / 'trackio'} is not writable" in r.stderr, r.stderr[-2000:]
    assert latest_checkpoint(tmp_path / 'run') is None and not (tmp_path / 'run' / 'drafter').exists()


def test_tree_loss_from_the_shell(w, tmp_path):
    "loss tree@N and treegrad@N: a run trains with each and its card names it; DSpark, a distribution term and a malformed name are refused before any work."
    args = ['--target', w / 'target', '--extracted', w / 'x', *BASE, '--max-steps', '2']
    assert cli(train_cli, *args, '--out', tmp_path / 'run', '--loss', 'tree@4')[0] == 0
    assert "its DDTree tree's reach at 4 nodes" in (tmp_path / 'run' / 'drafter' / 'README.md').read_text()
    assert cli(train_cli, *args, '--out', tmp_path / 'grad', '--loss', 'treegrad@4')[0] == 0
    assert "the gradient of its DDTree tree's reach at 4 nodes" in (tmp_path / 'grad' / 'drafter' / 'README.md').read_text()
    for extra, msg in ((['--loss', 'treegrad@4', '--arch', 'dspark'], "a DSpark drafter weighs its slots by 'decay' or 'dpace'"),
                       (['--loss', 'tree@4', '--loss-terms', 'ce:0.5,kl:0.5'], 'with loss_terms ce, not ce:0.5,kl:0.5'),
                       (['--loss', 'tree'], "'decay', 'dpace', 'tree@N' or 'treegrad@N'"), (['--loss', 'tree@999'], "'decay', 'dpace', 'tree@N' or 'treegrad@N'")):
        fails(train_cli, *args, '--out', tmp_path / 'bad', *extra, msg=msg)
        assert not (tmp_path / 'bad').exists()


def test_block_terms_from_the_shell(w, tmp_path):
    "loss_terms focal and chain: a run trains with them (its metrics finite, its card naming them); beside a distribution term or a DSpark drafter, or alone, refused before any work."
    args = ['--target', w / 'target', '--extracted', w / 'x', *BASE, '--max-steps', '2']
    assert cli(train_cli, *args, '--out', tmp_path / 'run', '--loss', 'decay', '--loss-terms', 'ce,focal:0.3,chain:40')[0] == 0
    card = (tmp_path / 'run' / 'drafter' / 'README.md').read_text()
    assert "CE + 0.3 x the first error's CE + 40 x the chain term" in card and '`--loss-terms ce,focal:0.3,chain:40`' in card
    losses = [json.loads(l)['loss'] for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines() if '"loss"' in l]
    assert losses and all(math.isfinite(x) and x > 0 for x in losses)
    for extra, msg in ((['--loss-terms', 'ce:0.5,kl:0.5,chain:40'], "are read from each row's CE: with ce alone"),
                       (['--loss-terms', 'ce,focal', '--arch', 'dspark'], 'and a DFlash or DFlash2 drafter'),
                       (['--loss-terms', 'chain:40'], 'need at least one row term')):
        fails(train_cli, *args, '--out', tmp_path / 'bad', *extra, msg=msg)
        assert not (tmp_path / 'bad').exists()
