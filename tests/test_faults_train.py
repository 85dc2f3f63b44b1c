"""Faults in the training job's newest paths (warm starts, resume, the disk, non-finite weights): each case asserts the exit
status, the one-line message, and that nothing earlier was lost or wrongly saved."""
import json, resource, shutil, signal, subprocess, sys
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file, save_file
from dflash.core import TRAIN_DATA, HELDOUT_DATA, read_metrics, read_jsonl
from dflash.data import prepare_cli
from dflash.extract import extract
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter
from dflash.train import train_cli
from dflash.checkpoint import latest_checkpoint
from test_faults import cli, fails, tree, kept

BIN = Path(sys.executable).parent
TRAIN = ['--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--log-every', '1', '--no-final-eval',
         '--no-progress', '--warmup', '0', '--val-data', 'none', '--no-servable']   # taps 1, 3 of 4 layers: llama.cpp's limit


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target, tok):
    "A random 4-layer hybrid target, 40 conversations, their extraction (taps 1, 3), and a drafter checkpoint for it."
    d = tmp_path_factory.mktemp('faults-train')
    t = save_target(make_target('qwen3_5'), d / 'target')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', t, '--out', d / 'data')[0] == 0
    extract(target=str(t), data=str(d / 'data'), out=str(d / 'x'), layer_ids=[1, 3], token_budget=512, progress=False)
    (d / 'held.jsonl').write_text(''.join(open(HELDOUT_DATA).readlines()[:12]))                 # a validation split of its own
    extract(target=str(t), data=str(d / 'held.jsonl'), out=str(d / 'val'), layer_ids=[1, 3], token_budget=512, progress=False)
    from transformers import AutoConfig
    save_drafter(DFlashDraftModel(drafter_config(AutoConfig.from_pretrained(t), 1, 16, tok.mask_token_id, [1, 3])), d / 'ck')
    return d


def broken(w, tmp_path, how):
    "A copy of the drafter checkpoint with its layer-0 tensors NaN, or its weights file cut short."
    ck = tmp_path / f'ck-{how}'; shutil.copytree(w / 'ck', ck)
    f = ck / 'model.safetensors'
    if how == 'nan':
        sd = load_file(f); sd = {k: v.fill_(float('nan')) if k.startswith('layers.0') else v for k, v in sd.items()}
        save_file(sd, f, metadata={'format': 'pt'})
    else: f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 3])
    return ck


def test_init_from_non_finite_weights_refused_naming_the_tensor(w, tmp_path):
    err = fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', '--init-from', broken(w, tmp_path, 'nan'),
                *TRAIN, '--max-steps', '4', msg='holds non-finite weights (NaN or inf) in layers.0.')
    assert 'model.safetensors' in err and not (tmp_path / 'run' / 'drafter').exists() and not (tmp_path / 'run' / 'checkpoints').exists()


def test_init_from_truncated_weights_names_the_file(w, tmp_path):
    ck = broken(w, tmp_path, 'cut')
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', '--init-from', ck, *TRAIN, '--max-steps', '4',
          msg=f'init_from: {ck}/model.safetensors is unreadable (truncated or corrupt?)')
    assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_a_loss_that_stays_nan_stops_the_run_with_its_steps_and_saves_no_drafter(w, tmp_path):
    "Taps that are all NaN from the start (as a broken extraction would hold): the run stops, naming the steps; no drafter."
    x = tmp_path / 'x'; shutil.copytree(w / 'x', x)
    from dflash.shards import read_manifest, update_manifest
    from dflash.core import file_sha256
    m = read_manifest(x)
    for s in m['shards']:
        sd = load_file(x / s['file']); sd['hidden_states'] = torch.full_like(sd['hidden_states'], float('nan'))
        save_file(sd, x / s['file']); s.update(sha256=file_sha256(x / s['file']), bytes=(x / s['file']).stat().st_size)
    (x / 'manifest.json').write_text(json.dumps(m))
    fails(train_cli, '--target', w / 'target', '--extracted', x, '--out', tmp_path / 'run', *TRAIN, '--max-steps', '8', '--ckpt-every', '0',
          msg='the loss or the gradient was not finite 3 steps in a row, steps 1 to 3')
    assert not (tmp_path / 'run' / 'drafter').exists() and latest_checkpoint(tmp_path / 'run') is None


def test_resume_into_an_out_without_a_run_is_refused(w, tmp_path):
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'typo', *TRAIN, '--max-steps', '2', '--resume',
          msg='holds no run to resume (no run.json, metrics.jsonl or checkpoints/)')
    assert not (tmp_path / 'typo').exists()


def test_resume_sets_aside_the_metrics_it_measures_again_and_says_where_it_resumed(w, tmp_path):
    "Killed after step 6's metrics but before its checkpoint: the resume from step 4 moves steps 5-6 aside, and each step is logged once."
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '6', '--ckpt-every', '2', '--keep', '3']
    assert cli(train_cli, *args)[0] == 0
    shutil.rmtree(tmp_path / 'run' / 'checkpoints' / 'step-6'); shutil.rmtree(tmp_path / 'run' / 'drafter'); (tmp_path / 'run' / 'result.json').unlink()
    first = [m for m in read_metrics(tmp_path / 'run') if 'loss' in m]
    r = subprocess.run([str(BIN / 'dflash_train'), *map(str, args), '--resume'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'resumed from' in r.stdout and 'at step 4; 2 metrics lines' in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    recs = read_metrics(tmp_path / 'run')
    assert [m['step'] for m in recs if 'loss' in m] == [1, 2, 3, 4, 5, 6]
    assert [m['step'] for m in read_jsonl(tmp_path / 'run' / 'metrics.after-4.jsonl')] == [5, 6]
    again = [m for m in recs if 'loss' in m]
    assert [m['loss'] for m in again] == [m['loss'] for m in first]         # the resumed steps are the same steps, bit for bit
    assert next(m for m in recs if m.get('event') == 'resume')['dropped'] == 2


def test_resume_sets_aside_a_best_drafter_measured_after_its_checkpoint(w, tmp_path):
    "Held-out evaluations at steps 5 and 6, killed before step 6's checkpoint: the resume from step 4 moves the best aside and measures again."
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '6', '--ckpt-every', '2',
            '--keep', '3', '--val-extracted', w / 'val', '--eval-every', '5']
    assert cli(train_cli, *args)[0] == 0
    best = json.loads((tmp_path / 'run/checkpoints/best/BEST.json').read_text())
    assert best['step'] in (5, 6)
    shutil.rmtree(tmp_path / 'run' / 'checkpoints' / 'step-6'); shutil.rmtree(tmp_path / 'run' / 'drafter'); (tmp_path / 'run' / 'result.json').unlink()
    r = subprocess.run([str(BIN / 'dflash_train'), *map(str, args), '--resume'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    aside = json.loads((tmp_path / 'run/checkpoints/best.after-4/BEST.json').read_text())
    again = json.loads((tmp_path / 'run/checkpoints/best/BEST.json').read_text())
    assert aside['step'] == best['step'] and (again['step'], again['val_tau']) == (best['step'], best['val_tau'])   # the same steps again
    assert [m['step'] for m in read_metrics(tmp_path / 'run') if 'val_tau' in m] == [5, 6]


def test_full_disk_at_the_first_checkpoint_says_none_is_kept(w, tmp_path):
    "Files capped at 8 KB: the first checkpoint cannot be written; the message names the file and says no checkpoint exists yet."
    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))
    (tmp_path / 'run').mkdir()
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '2', '--ckpt-every', '1']
    r = subprocess.run([str(BIN / 'dflash_train'), *map(str, args)], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert r.returncode == 1 and 'the disk is full' in r.stderr and 'model.safetensors' in r.stderr, r.stderr[-2000:]
    assert 'No checkpoint of this run is complete yet' in r.stderr and 'is kept' not in r.stderr
    assert latest_checkpoint(tmp_path / 'run') is None and not list((tmp_path / 'run' / 'checkpoints').glob('.step-*'))


def test_evaluate_refuses_a_drafter_with_non_finite_weights(w, tmp_path):
    "A NaN drafter drafts nothing, so the loop would report tau 1.00 and 'lossless': refused instead, naming the tensor and the file."
    from dflash.evaluate import evaluate_cli
    ck = broken(w, tmp_path, 'nan')
    err = fails(evaluate_cli, '--target', w / 'target', '--drafter', ck, '--out', tmp_path / 'ev', '--num-prompts', '1', '--max-new-tokens', '4',
                msg=f'drafter: {ck}/model.safetensors holds non-finite weights (NaN or inf) in layers.0.')
    assert not (tmp_path / 'ev' / 'results.json').exists()
