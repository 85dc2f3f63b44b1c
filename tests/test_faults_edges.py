"""Faults at the edges of trees, DSpark, the losses and the end-of-run checks: each case asserts the exit status and the one-line
message of a bad setting, refused before anything runs, or what a run that cannot learn does (nothing published)."""
import json, shutil, time
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file, save_file
from dflash.core import TINY_TARGET, TRAIN_DATA, HELDOUT_DATA, file_sha256
from dflash.data import prepare_cli
from dflash.extract import extract
from dflash.evaluate import evaluate_cli
from dflash.train import train_cli
from dflash.recipe import TrainConfig
from dflash.resolve import resolve, drafter_for
from dflash.taps import load_target_config
from dflash.checkpoint import latest_checkpoint
from dflash.shards import read_manifest
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter
from test_faults import cli, fails

TRAIN = ['--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--log-every', '1', '--no-final-eval',
         '--no-progress', '--warmup', '0', '--val-data', 'none', '--no-servable']   # taps 1, 3 of 4 layers: llama.cpp's limit


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target, tok):
    """A random 4-layer hybrid target, 24 conversations, their extraction (taps 1, 3), a copy of it whose taps are all NaN, and a DFlash
    drafter checkpoint for the target."""
    d = tmp_path_factory.mktemp('faults-edges')
    t = save_target(make_target('qwen3_5'), d / 'target')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:24]))
    assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', t, '--out', d / 'data')[0] == 0
    extract(target=str(t), data=str(d / 'data'), out=str(d / 'x'), layer_ids=[1, 3], token_budget=512, progress=False)
    shutil.copytree(d / 'x', d / 'nan')
    m = read_manifest(d / 'nan')
    for s in m['shards']:
        f = d / 'nan' / s['file']
        sd = load_file(f); sd['hidden_states'] = torch.full_like(sd['hidden_states'], float('nan')); save_file(sd, f)
        s.update(sha256=file_sha256(f), bytes=f.stat().st_size)
    (d / 'nan' / 'manifest.json').write_text(json.dumps(m))
    from transformers import AutoConfig
    save_drafter(DFlashDraftModel(drafter_config(AutoConfig.from_pretrained(t), 1, 16, tok.mask_token_id, [1, 3])), d / 'ck')
    return d


# --- tree budgets: one bound for every budget parameter, refused at once with the reason ------------------------------

@pytest.mark.parametrize('opt', ['--val-tree-budgets', '--eval-tree-budget'])
def test_train_refuses_an_unbounded_tree_budget_at_once(w, tmp_path, opt):
    t0 = time.time()
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *TRAIN, opt, '100000',
          msg='=100000: a DDTree budget is a number of nodes in 0..1024: a tree of N nodes is verified as N + 1 positions')
    assert time.time() - t0 < 20 and not (tmp_path / 'run').exists()


def test_evaluate_refuses_an_unbounded_tree_budget_at_once(w, tmp_path):
    t0 = time.time()
    fails(evaluate_cli, '--tree-budget', '100000', '--drafter', w, '--out', tmp_path / 'e', msg='tree_budget=100000: a DDTree budget is a number of nodes in 0..1024')
    assert time.time() - t0 < 20 and not (tmp_path / 'e').exists()


def test_spec_decode_refuses_an_unbounded_tree_budget():
    from dflash.evaluate import spec_decode
    with pytest.raises(ValueError, match='tree_budget=5000: a DDTree budget'): spec_decode(None, None, [1, 2], tree_budget=5000)


def test_evaluate_refuses_a_confidence_threshold_for_a_drafter_without_a_confidence_head(w, tmp_path):
    "A DFlash drafter has no confidence head: its 'scheduled' row would be the chain's again. Refused before anything loads."
    fails(evaluate_cli, '--target', w / 'target', '--drafter', w / 'ck', '--confidence-threshold', '0.5', '--out', tmp_path / 'e',
          msg='confidence_threshold=0.5: ' + str(w / 'ck') + ' is a DFlashDraftModel drafter without a confidence head')
    assert not (tmp_path / 'e' / 'results.json').exists()
    from dflash.evaluate import DFlashDrafter
    with pytest.raises(ValueError, match='has no confidence head'): DFlashDrafter(DFlashDraftModel.from_pretrained(w / 'ck'), 0.5)


# --- the losses: finite weights only, and a run that never stepped publishes nothing -------------------------------------------

@pytest.mark.parametrize('terms', ['ce:inf', 'ce:1,kl:inf', 'ce:nan', 'ce:1e999'])
def test_train_refuses_a_loss_weight_that_is_not_finite(w, tmp_path, terms):
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'run', *TRAIN, '--loss-terms', terms,
          msg='the weight must be a finite number >= 0')
    assert not (tmp_path / 'run').exists()


def test_a_run_whose_every_step_is_non_finite_publishes_nothing(w, tmp_path):
    "Two steps, both skipped (fewer than the 3-in-a-row stop): the run says each one, then refuses to publish the untrained drafter."
    err = fails(train_cli, '--target', w / 'target', '--extracted', w / 'nan', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '2',
                '--ckpt-every', '0', msg="the loss or the gradient was not finite at any of the run's 2 optimizer steps")
    assert err.count('is not finite: the step is skipped') == 2 and 'nothing is published' in err
    assert not (tmp_path / 'run' / 'drafter').exists() and not (tmp_path / 'run' / 'result.json').exists()


# --- settings the run never reads, and what the start-up check owes the end-of-run engine check ---------------------------

def test_final_loop_settings_are_inert_without_the_final_evaluation():
    warned = TrainConfig(final_eval=False, eval_tree_budget=4, engine_eval=True).inert()
    assert any(x.startswith('eval_tree_budget=4 has no effect: it is read only with final_eval') for x in warned), warned
    assert any(x.startswith('engine_eval=True has no effect: it is read only with final_eval') for x in warned), warned
    assert not TrainConfig(eval_tree_budget=4, engine_eval=True).inert()


def test_the_demo_checks_what_llamacpp_serves_at_the_start_when_the_engine_check_will_run(tmp_path):
    """DFlash2 on the embedded target (hidden 256 < 16 * 17): llama.cpp cannot serve it. Where the run would end with the engine check,
    it is told at the start and the end-of-run check is off; asked for explicitly, the check refuses the run at once."""
    pytest.importorskip('xllamacpp')
    base = dict(arch='dflash2', val_data='none', max_steps=1, progress=False, eval_prompts=1)
    cfg = resolve(TrainConfig(**base, out=str(tmp_path / 'a'))).config
    assert cfg.engine_eval is False and any('selector_top_k * (selector_top_k + 1) = 272' in x for x in cfg.warnings), cfg.warnings
    with pytest.raises(ValueError, match='272; the target has 256'): resolve(TrainConfig(**base, engine_eval=True, out=str(tmp_path / 'b')))
    assert resolve(TrainConfig(**base, engine_eval=False, out=str(tmp_path / 'c'))).config.engine_eval is False   # no engine check: no word
    assert resolve(TrainConfig(**base, final_eval=False, out=str(tmp_path / 'd'))).config.warnings == []


def test_a_dspark_config_records_the_runs_anchors():
    cfg = TrainConfig(arch='dspark', num_anchors=4, num_layers=1, val_data='none')
    cfg.set('layer_ids', [2], 'test')
    assert drafter_for(cfg, load_target_config(TINY_TARGET), 5).num_anchors == 4
