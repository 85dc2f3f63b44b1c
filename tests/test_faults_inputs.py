"""Inputs that belong to another drafter, target or tap, and files tied to a drafter's weights: every job that reads an extraction,
a profile or a temperatures file checks it as training does (`dflash.evaluate.check_inputs`, `check_extraction`), before anything runs."""
import json, os, shutil, warnings
import pytest, torch
from transformers import AutoConfig, AutoModelForCausalLM
from dflash.core import TRAIN_DATA
from dflash.data import prepare_cli
from dflash.extract import extract
from dflash.engine import engine_cli
from dflash.treecal import treecal_cli
from dflash.evaluate import check_inputs, load_drafter
from dflash.shards import check_extraction, read_manifest
from dflash.speedup import write_profile
from dflash.train import train_cli
from dflash.tree import write_tree_temperatures, read_tree_temperatures, TREE_T_FILE
from dflash.taps import load_target
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter
from test_faults import cli, fails

TRAIN = ['--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--log-every', '1', '--no-final-eval',
         '--no-progress', '--warmup', '0', '--val-data', 'none']


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target, tok):
    """Target A (a random 4-layer hybrid), a fine-tuned copy of it (the same config, other weights), target B (another config); 16
    conversations extracted from A at the taps [1, 2] and [1, 3], from B at [1, 2], and from A at [1, 2] cut short (incomplete); a DFlash
    drafter for A at [1, 2]."""
    d = tmp_path_factory.mktemp('faults-inputs')
    a = save_target(make_target('qwen3_5'), d / 'A')
    tuned = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    with torch.no_grad():
        for p in tuned.parameters(): p += 1e-2
    save_target(tuned, d / 'A-tuned')
    b = save_target(make_target('qwen3_5', hidden=32, layers=4), d / 'B')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:16]))
    for t in ('A', 'B'): assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', d / t, '--out', d / f'data-{t}')[0] == 0
    for name, t, taps in (('xA', 'A', [1, 2]), ('xA13', 'A', [1, 3]), ('xB', 'B', [1, 2])):
        extract(target=str(d / t), data=str(d / f'data-{t}'), out=str(d / name), layer_ids=taps, token_budget=512, progress=False)
    shutil.copytree(d / 'xA', d / 'xA-cut')
    m = read_manifest(d / 'xA-cut'); m['complete'] = False; m['shards'] = m['shards'][:1]
    (d / 'xA-cut' / 'manifest.json').write_text(json.dumps(m))
    save_drafter(DFlashDraftModel(drafter_config(AutoConfig.from_pretrained(a), 1, 4, tok.mask_token_id, [1, 2])), d / 'ck')
    return d


# --- one check for every job: the drafter's target, the extraction's target (config, tokenizer, weights) and taps, whole --------

def test_check_inputs_names_what_does_not_belong(w):
    assert check_inputs(w / 'ck', w / 'A', w / 'xA').layer_ids == [1, 2]
    with pytest.raises(ValueError, match=r'is a drafter for .*hidden size 64.*use it with the target it was trained for'): check_inputs(w / 'ck', w / 'B')
    with pytest.raises(ValueError, match=r'whose config differs from the target'): check_inputs(w / 'ck', w / 'A', w / 'xB')
    with pytest.raises(ValueError, match=r'the drafter reads the taps \[1, 2\]; the extraction .*xA13 holds the taps \[1, 3\]'): check_inputs(w / 'ck', w / 'A', w / 'xA13')
    with pytest.raises(ValueError, match='whose weights differ from the target'): check_extraction(w / 'xA', w / 'A-tuned')
    assert read_manifest(w / 'xA')['target_weights_sha256'] and check_extraction(w / 'xA', w / 'A') is not None


def test_check_inputs_refuses_an_incomplete_extraction(w):
    with pytest.raises(ValueError, match='the extraction is not complete'): check_inputs(w / 'ck', w / 'A', w / 'xA-cut')


# --- dflash_engine --profile: the extraction and the lengths checked before llama.cpp runs -----------------------------------------

@pytest.mark.parametrize('x,msg', [('xB', 'whose config differs from the target'), ('xA13', 'the drafter reads the taps [1, 2]')])
def test_engine_profile_refuses_another_targets_or_taps_extraction_at_once(w, tmp_path, x, msg):
    fails(engine_cli, '--drafter', w / 'ck', '--target', w / 'A', '--profile', '--val-extracted', w / x, '--out', tmp_path / 'e', msg=msg)
    assert not (tmp_path / 'e' / 'engine.json').exists()


@pytest.mark.parametrize('lengths,bad', [('0', '[0]'), ('-1,1', '[-1]'), ('1,8', '[8]')])
def test_engine_profile_lengths_checked_at_start(w, tmp_path, lengths, bad):
    fails(engine_cli, '--drafter', w / 'ck', '--target', w / 'A', '--profile', f'--profile-lengths={lengths}', '--out', tmp_path / 'e',
          msg=f'profile_lengths: {bad} not in 1..3')


def test_a_junk_llamacpp_verbosity_is_named(w, tmp_path, monkeypatch):
    monkeypatch.setenv('DFLASH_LLAMACPP_VERBOSITY', 'junk')
    fails(engine_cli, '--drafter', w / 'ck', '--target', w / 'A', '--out', tmp_path / 'e', msg="DFLASH_LLAMACPP_VERBOSITY='junk': llama.cpp's log level")
    fails(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '2', '--final-eval', '--engine-eval',
          msg="DFLASH_LLAMACPP_VERBOSITY='junk'")
    assert not (tmp_path / 'run' / 'run.json').exists()


# --- dflash_treecal: the same check, the drafter's folder writable, a broken file replaced ------------------------------------------

@pytest.mark.parametrize('x,msg', [('xB', 'whose config differs from the target'), ('xA13', 'the drafter reads the taps [1, 2]'),
                                   ('xA-cut', 'the extraction is not complete')])
def test_treecal_refuses_another_targets_or_taps_or_an_incomplete_extraction(w, tmp_path, x, msg):
    code, err = cli(treecal_cli, '--drafter', w / 'ck', '--target', w / 'A', '--extracted', w / x)
    assert code == 1 and msg in err and not (w / 'ck' / TREE_T_FILE).exists(), err[-1500:]


def test_treecal_replaces_a_broken_file_and_a_chain_only_warns(w, tmp_path):
    ck = tmp_path / 'ck'; shutil.copytree(w / 'ck', ck)
    (ck / TREE_T_FILE).write_text('{"temps": [1]}')
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        m = load_drafter(ck, load_target(w / 'A', dtype=torch.float32))              # a chain never reads the file: a warning at most
    assert any('not a tree-temperature file' in str(x.message) for x in ws)
    with pytest.raises(ValueError, match='not a tree-temperature file'): m.tree_scale(3)   # a tree refuses it
    code, err = cli(treecal_cli, '--drafter', ck, '--target', w / 'A', '--extracted', w / 'xA', '--max-blocks', '16', '--sweeps', '1', '--budgets', '4')
    assert code == 0, err[-2000:]
    assert len(read_tree_temperatures(ck, 3)) == 3


# --- files tied to the weights: a drafter saved again sets its old temperatures aside --------------------------------------------

def test_temperatures_of_other_weights_are_not_applied(w, tmp_path, tok):
    ck = tmp_path / 'ck'; shutil.copytree(w / 'ck', ck)
    write_tree_temperatures(ck, [2.0, 2.0, 2.0], budget=16)
    m = load_drafter(ck, load_target(w / 'A', dtype=torch.float32))
    assert m.tree_temperatures == [2.0, 2.0, 2.0]
    torch.manual_seed(1)
    save_drafter(DFlashDraftModel(drafter_config(AutoConfig.from_pretrained(w / 'A'), 1, 4, tok.mask_token_id, [1, 2])), ck)  # published again
    assert not (ck / TREE_T_FILE).exists() and (ck / 'tree_temperatures.stale.json').exists()
    shutil.copy(ck / 'tree_temperatures.stale.json', ck / TREE_T_FILE)                  # put back by hand: still not applied
    with pytest.warns(UserWarning, match='fitted to other weights'): assert load_drafter(ck, load_target(w / 'A', dtype=torch.float32)).tree_temperatures is None


# --- training: a profile that predicts nothing, and resumes against another profile or other target weights ----------------------

def test_a_profile_without_the_blocks_lengths_is_refused_at_start(w, tmp_path):
    p = write_profile(tmp_path / 'p.json', 10.0, {8: 30.0}, {7: 5.0})
    fails(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', tmp_path / 'run', *TRAIN, '--block-size', '4', '--no-servable',
          '--engine-profile', p, '--max-steps', '2',
          msg='no costs at a length this drafter drafts (1..3 a step): it lacks verify_ms of [2, 3, 4] tokens; draft_ms of [1, 2, 3] drafted')
    assert not (tmp_path / 'run').exists()


def test_a_resume_checks_the_profiles_costs_and_the_targets_weights(w, tmp_path):
    p = write_profile(tmp_path / 'p.json', 10.0, {2: 12.0, 3: 13.0, 4: 14.0}, {1: 5.0, 2: 5.5, 3: 6.0})
    run = tmp_path / 'run'
    args = ['--extracted', w / 'xA', '--out', run, *TRAIN, '--block-size', '4', '--no-servable', '--engine-profile', p, '--ckpt-every', '2']
    assert cli(train_cli, '--target', w / 'A', *args, '--max-steps', '2')[0] == 0
    write_profile(p, 10.0, {2: 24.0, 3: 26.0, 4: 28.0}, {1: 5.0, 2: 5.5, 3: 6.0})       # the same path, other costs
    before = sorted(x.name for x in run.iterdir())
    fails(train_cli, '--target', w / 'A', *args, '--max-steps', '4', '--resume', msg="engine_profile=")
    assert sorted(x.name for x in run.iterdir()) == before                               # refused before anything moved
    fails(train_cli, '--target', w / 'A-tuned', *args, '--max-steps', '4', '--resume', '--resume-changes', 'engine_profile,max_steps',
          msg="target_weights='sha256")                                                  # the same config, fine-tuned weights
    assert sorted(x.name for x in run.iterdir()) == before
    code, err = cli(train_cli, '--target', w / 'A', *args, '--max-steps', '4', '--resume', '--resume-changes', 'engine_profile,max_steps')
    assert code == 0, err[-2000:]
    ev = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines() if '"resume"' in l]
    assert 'engine_profile' in ev[-1]['changed']
    code, err = cli(train_cli, '--target', w / 'A', *args, '--max-steps', '6', '--resume', '--resume-changes', 'max_steps')   # the same costs: no change
    assert code == 0, err[-2000:]


def test_a_resume_into_a_tree_loss_for_dspark_is_refused_before_anything_is_written(w, tmp_path):
    run = tmp_path / 'run'
    args = ['--target', w / 'A', '--extracted', w / 'xA', '--out', run, *TRAIN, '--no-servable', '--ckpt-every', '2']
    code, err = cli(train_cli, *args, '--arch', 'dspark', '--loss-terms', 'ce', '--block-size', '4', '--max-steps', '2'); assert code == 0, err[-2000:]
    before = {x.name: x.stat().st_mtime_ns for x in run.iterdir()}
    cfg = (run / 'config.json').read_text()
    fails(train_cli, *args, '--max-steps', '4', '--resume', '--loss', 'tree@16', '--resume-changes', 'loss',
          msg="a DSpark drafter weighs its slots by 'decay' or 'dpace'")
    assert {x.name: x.stat().st_mtime_ns for x in run.iterdir()} == before and (run / 'config.json').read_text() == cfg


def test_treecal_on_a_read_only_drafter_refuses_before_the_fit(w, tmp_path):
    "A drafter folder it cannot write (a read-only mount, an immutable folder): refused at once, before the fit it would lose."
    import subprocess
    ck = tmp_path / 'ck'; shutil.copytree(w / 'ck', ck)
    if os.geteuid() == 0:
        if shutil.which('chattr') is None or subprocess.run(['chattr', '+i', str(ck)], capture_output=True).returncode:
            pytest.skip('root, and no immutable folders here: nothing is read-only to root')
    else: ck.chmod(0o555)
    try:
        fails(treecal_cli, '--drafter', ck, '--target', w / 'A', '--extracted', w / 'xA', msg=f'drafter: {ck} is not writable')
    finally:
        subprocess.run(['chattr', '-i', str(ck)], capture_output=True) if os.geteuid() == 0 else ck.chmod(0o755)
    assert not (ck / TREE_T_FILE).exists()


def test_settings_a_run_never_reads_are_marked(w):
    from dflash.recipe import TrainConfig
    line = lambda d, k: next(l for l in d.splitlines() if l.strip().startswith(k + ' '))
    online, offline = TrainConfig().describe(), TrainConfig(extracted=str(w / 'xA')).describe()
    assert 'not read' not in line(online, 'targets') and 'not read' not in line(online, 'data')
    for k in ('targets', 'data'): assert '(not read: only with online training (no extracted))' in line(offline, k)


def test_treecal_without_target_names_the_default_it_compared(w):
    "A drafter of another target with --target left out: the default (SmolLM2) is compared first, and the message says to give --target."
    code, err = cli(treecal_cli, '--drafter', w / 'ck', '--extracted', w / 'xA')
    assert code == 1 and 'is a drafter for' in err and '(target left out: SmolLM2-135M-Instruct; give --target)' in err, err[-1500:]
