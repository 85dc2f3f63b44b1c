"""The training job with DFlash2, D-PACE and sampled evaluation: a DFlash2 run starts as an exact copy of a DFlash drafter and
trains with the selector's loss (candidate recall logged), a published-layout DFlash2 checkpoint warm-starts one, D-PACE is a
parameter, and the final evaluation samples at the temperature asked for."""
import json
import pytest, torch
from transformers import AutoConfig
from dflash.core import TRAIN_DATA, read_metrics
from dflash.data import prepare_cli
from dflash.extract import extract
from dflash.extracted import ExtractedDataset
from dflash.feed import OfflineSource
from dflash.batching import Plan
from dflash.dist import Coord
from dflash.recipe import TrainConfig
from dflash.trainer import Trainer
from dflash.resolve import resolve
from dflash.train import train, train_cli
from dflash.dflash2 import DFlash2DraftModel
from dflash.evaluate import load_drafter
from conftest import write_published_dflash2
from test_faults import cli, fails

RUN = dict(drafters=1, num_layers=1, num_anchors=8, token_budget=512, lr=3e-3, warmup=0, log_every=1, final_eval=False, progress=False,
           val_data='none', ckpt_every=0)


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target):
    "A random 8-layer hybrid target, 40 conversations and their extraction at taps 1, 3, 5."
    d = tmp_path_factory.mktemp('arch')
    t = save_target(make_target('qwen3_5', layers=8), d / 'target')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', t, '--out', d / 'data')[0] == 0
    extract(target=str(t), data=str(d / 'data'), out=str(d / 'x'), layer_ids=[1, 3, 5], token_budget=512, progress=False)
    return d


def trainer(w, tmp_path, **kw):
    cfg = TrainConfig(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / kw.pop('name', 'run')), layer_ids=[1, 3, 5],
                      mask_token_id=3, servable=False, **{**RUN, 'max_steps': 2, **kw})
    xds = ExtractedDataset(w / 'x')
    plan = Plan(xds.lengths, cfg.token_budget, cfg.max_batch_size, 1, cfg.seed, max_steps=cfg.max_steps)
    return Trainer(resolve(cfg), Coord(__import__('torch.distributed', fromlist=['HashStore']).HashStore(), 0, 1, cfg.roles()), 0, plan,
                   torch.device('cpu')), OfflineSource(xds, plan, 0, 0, plan.total_micro, 'cpu')


def test_a_dflash2_run_starts_as_an_exact_copy_of_the_dflash_one(w, tmp_path):
    same = dict(block_size=16, layer_types='full', is_causal=False)   # given: a DFlash2 run on a hybrid would take the published layout
    (one, src), (two, _) = trainer(w, tmp_path, name='one', **same), trainer(w, tmp_path, name='two', arch='dflash2', **same)
    assert isinstance(two.model, DFlash2DraftModel) and not isinstance(one.model, DFlash2DraftModel)
    item = src.get()
    with torch.no_grad():
        a = one.model(item['hidden_states'], item['input_ids'], item['loss_mask'], num_anchors=8, return_logits=True, generator=torch.Generator().manual_seed(0))
        b = two.model(item['hidden_states'], item['input_ids'], item['loss_mask'], num_anchors=8, return_logits=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hits, b.hits)         # the same function, the selector's path the head's argmax
    shared = {k: v for k, v in one.model.state_dict().items()}
    assert all(torch.equal(v, two.model.state_dict()[k]) for k, v in shared.items())


def test_dflash2_trains_with_the_selector_loss_and_logs_candidate_recall(w, tmp_path):
    res = train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'd2'), layer_ids=[1, 3, 5], arch='dflash2', loss='dpace',
                servable=False, **{**RUN, 'max_steps': 4, 'ckpt_every': 2})      # hidden 64: below llama.cpp's bound for DFlash2's selector
    recs = [m for m in read_metrics(tmp_path / 'd2') if 'loss' in m]
    assert len(recs) == 4 and all(len(m['candidate_recall']) == 7 and len(m['unary_acc']) == 7 for m in recs)   # block 8, as published
    assert all(0 <= r <= 1 for m in recs for r in m['candidate_recall'])
    c = json.loads((tmp_path / 'd2/drafter/config.json').read_text())
    assert c['architectures'] == ['DFlash2DraftModel'] and c['dflash_config']['selector_top_k'] == 16 and c['block_size'] == 8
    assert c['layer_types'] == ['sliding_attention'] and c['sliding_window'] == 2048 and c['is_causal'] is False   # the published layout, a hybrid target
    assert 'D-PACE' in (tmp_path / 'd2/drafter/README.md').read_text() and 'DFlash2' in (tmp_path / 'd2/drafter/README.md').read_text()
    # killed after step 4 but before its checkpoint: resumed from step 2, it trains steps 3 and 4 exactly as before
    import shutil
    shutil.rmtree(tmp_path / 'd2/checkpoints/step-4'); shutil.rmtree(tmp_path / 'd2/drafter'); (tmp_path / 'd2/result.json').unlink()
    train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'd2'), layer_ids=[1, 3, 5], arch='dflash2', loss='dpace',
          resume=True, **{**RUN, 'max_steps': 4, 'ckpt_every': 2})
    again = [m for m in read_metrics(tmp_path / 'd2') if 'loss' in m]
    assert [m['step'] for m in again] == [1, 2, 3, 4] and [m['loss'] for m in again] == [m['loss'] for m in recs]


def test_dpace_is_a_parameter_and_changes_the_loss(w, tmp_path):
    (dec, src), (dp, _) = trainer(w, tmp_path, name='dec', loss='decay'), trainer(w, tmp_path, name='dp', loss='dpace')
    item = src.get()
    assert dec.micro_step(item, True).loss.item() != dp.micro_step(item, True).loss.item()
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'bad', '--loss', 'focal', msg="loss='focal': 'decay', 'dpace', 'tree@N' or 'treegrad@N'")
    assert trainer(w, tmp_path, name='default')[0].cfg.loss == 'dpace'          # the recipe's loss for a real target


def test_a_published_dflash2_checkpoint_warm_starts_a_run(w, tmp_path, tok):
    "Hand-written in the published layout (bare codebook names, is_causal false, all sliding, block 8): the run takes its settings and weights."
    ck = tmp_path / 'pub'; ck.mkdir()
    write_published_dflash2(ck, tok, H=64, n=2, taps_=(1, 3, 5), num_target_layers=8)
    res = train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'warm'), init_from=str(ck),
                **{**RUN, 'num_layers': None, 'max_steps': 1, 'lr': 1e-12})
    cfg = json.loads((tmp_path / 'warm/config.json').read_text())
    assert cfg['config']['arch'] == 'dflash2' and cfg['config']['block_size'] == 8 and cfg['config']['is_causal'] is False
    assert cfg['origins']['arch'].startswith('init_from')
    got = load_drafter(tmp_path / 'warm/drafter', __import__('dflash.taps', fromlist=['load_target']).load_target(str(w / 'target')))
    ref = DFlash2DraftModel.from_pretrained(ck, dtype=torch.float32)
    assert isinstance(got, DFlash2DraftModel) and got.config.is_causal is False
    assert all(torch.allclose(v, got.state_dict()[k], atol=1e-2) for k, v in ref.state_dict().items())   # lr 1e-12: the start itself (bf16)


def test_the_final_evaluation_samples_at_the_temperature_asked(w, tmp_path):
    res = train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'hot'), layer_ids=[1, 3, 5],
                **{**RUN, 'max_steps': 2, 'final_eval': True, 'eval_prompts': 1, 'eval_max_new_tokens': 6, 'eval_temperature': 0.7})
    assert res['lossless'] and res['eval_temperature'] == 0.7 and res['tau_sampled'] >= 1
    card = (tmp_path / 'hot/drafter/README.md').read_text()
    assert 'sampled at temperature 0.7' in card and 'T = 0.7' in card or 'T=0.7' in card


def test_a_dspark_run_trains_saves_as_served_and_drafts_losslessly(w, tmp_path):
    from safetensors import safe_open
    from dflash.dspark import DSparkDraftModel
    from dflash.evaluate import DFlashDrafter, evaluate, load_prompts
    from dflash.validate import heldout_acceptance
    from dflash.taps import load_target, load_tokenizer
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'paper', '--arch', 'dspark', '--layer_ids', '1,3,5',
          msg="needs its final hidden states")                              # the paper's loss: this extraction has no final states
    train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'ds'), layer_ids=[1, 3, 5], arch='dspark', loss_terms='ce',
          mask_token_id=3, servable=False, **{**RUN, 'max_steps': 3})
    recs = [m for m in read_metrics(tmp_path / 'ds') if 'loss' in m]
    assert len(recs) == 3 and all(len(m['acc']) == 7 for m in recs)          # block 7: all 7 slots draft
    c = json.loads((tmp_path / 'ds/drafter/config.json').read_text())
    assert c['architectures'] == ['Qwen3DSparkModel'] and c['block_size'] == 7 and c['markov_rank'] == 256 and c['enable_confidence_head']
    with safe_open(tmp_path / 'ds/drafter/model.safetensors', 'pt') as f: keys = set(f.keys())
    card = (tmp_path / 'ds/drafter/README.md').read_text()
    assert '# DSpark drafter' in card and '"method": "dspark"' in card and '"num_speculative_tokens": 7' in card and 'DSPARK' in card
    assert {'markov_head.markov_w1.weight', 'markov_head.markov_w2.weight', 'confidence_head.proj.weight', 'fc.weight'} <= keys
    target = load_target(str(w / 'target')).eval()
    d = load_drafter(tmp_path / 'ds/drafter', target)
    assert isinstance(d, DSparkDraftModel) and d.draft_len == 7
    prompts = load_prompts(load_tokenizer(str(w / 'target')), n=2)
    r = evaluate(target, d, prompts, 24, strict=True)
    assert r['lossless'] and r['block_size'] == 8 and 1 <= r['tau'] <= 8
    # the confidence head: calibrated on held-out blocks (its temperatures kept beside the best), and a shorter verify when asked
    h = heldout_acceptance(d, w / 'x', max_samples=8)
    assert len(h['val_sts']) == 7 and all(t > 0 for t in h['val_sts']) and 0 <= h['val_conf_ece_sts'] <= 1 and 0 <= h['val_conf_ece'] <= 1
    s = evaluate(target, DFlashDrafter(d, confidence_threshold=0.9), prompts, 24, strict=True)
    assert s['lossless'] and s['drafted_per_step'] < r['drafted_per_step'], (s['drafted_per_step'], r['drafted_per_step'])
    hot = evaluate(target, DFlashDrafter(d, confidence_threshold=0.9), prompts, 24, temperature=0.7)
    assert hot['drafted_per_step'] < 7 and hot['new_tokens'] == 48


def test_an_xpress_run_trains_saves_for_vllm_and_drafts_losslessly(w, tmp_path):
    from safetensors import safe_open
    from dflash.xpress import XPressDraftModel
    from dflash.evaluate import evaluate, load_prompts
    from dflash.validate import heldout_acceptance
    from dflash.taps import load_target, load_tokenizer
    args = ('--target', w / 'target', '--extracted', w / 'x', '--layer_ids', '1,3,5', '--arch', 'xpress', '--mask-token-id', '3')
    fails(train_cli, *args, '--out', tmp_path / 'paper', msg="need the target's distribution")   # speculators' loss: 0.1 CE + 0.9 TV
    fails(train_cli, *args, '--out', tmp_path / 'tree', '--loss-terms', 'ce', '--val-tree-budgets', '16', msg='drafts one chain')
    fails(train_cli, *args, '--out', tmp_path / 'dpace', '--loss-terms', 'ce', '--loss', 'dpace', msg="weighs its slots by 'decay'")
    train(target=str(w / 'target'), extracted=str(w / 'x'), out=str(tmp_path / 'xp'), layer_ids=[1, 3, 5], arch='xpress', loss_terms='ce',
          xpress_rank=16, mask_token_id=3, **{**RUN, 'max_steps': 3})
    recs = [m for m in read_metrics(tmp_path / 'xp') if 'loss' in m]
    assert len(recs) == 3 and all(len(m['acc']) == 15 for m in recs)          # block 16: slots 1..15 draft
    c = json.loads((tmp_path / 'xp/drafter/config.json').read_text())
    assert c['architectures'] == ['Qwen3XPressModel'] and c['xpress_block_size'] == 16 and c['xpress_rank'] == 16
    with safe_open(tmp_path / 'xp/drafter/model.safetensors', 'pt') as f: keys = set(f.keys())
    assert {'xpress_head.w1.weight', 'xpress_head.w2.weight', 'xpress_head.mix.L', 'fc.weight'} <= keys
    card = (tmp_path / 'xp/drafter/README.md').read_text()
    assert '# XPress drafter' in card and '"method": "dflash"' in card and 'llama.cpp have no XPress drafter' in card
    target = load_target(str(w / 'target')).eval()
    d = load_drafter(tmp_path / 'xp/drafter', target)
    assert isinstance(d, XPressDraftModel) and d.draft_len == 15
    r = evaluate(target, d, load_prompts(load_tokenizer(str(w / 'target')), n=2), 24, strict=True)
    assert r['lossless'] and 1 <= r['tau'] <= 16
    h = heldout_acceptance(d, w / 'x', max_samples=8)
    assert 1 <= h['val_tau'] <= 16
