"""Held-out acceptance against the lossless loop: on the target's own greedy replies, the loop's path through the per-position
counts of one forward (`val_tau_walk`) is the loop's tau, exactly; and a training run publishes its best drafter."""
import json
from pathlib import Path
import pytest, torch
from dflash.core import TINY_TARGET, HELDOUT_REGEN, read_metrics
from dflash.extract import extract
from dflash.extracted import ExtractedDataset
from dflash.taps import load_target, load_tokenizer
from dflash.evaluate import evaluate, greedy_reference, load_drafter, load_prompts
from dflash.validate import heldout_acceptance, better
from dflash.train import train


@pytest.fixture(scope='module')
def memorized(tmp_path_factory):
    """A 1-layer drafter trained offline on 12 of the embedded target's held-out replies (so that it accepts a lot), their taps, and
    the taps of 12 other replies, its validation split (a run refuses to validate on what it trains on)."""
    d = tmp_path_factory.mktemp('validate')
    rows = open(HELDOUT_REGEN).readlines()
    (d / 'few.jsonl').write_text(''.join(rows[:12])); (d / 'val.jsonl').write_text(''.join(rows[12:24]))
    x = extract(data=str(d / 'few.jsonl'), out=str(d / 'x'), layer_ids=[4], progress=False)
    v = extract(data=str(d / 'val.jsonl'), out=str(d / 'v'), layer_ids=[4], progress=False)
    res = train(extracted=x['out'], out=str(d / 'run'), drafters=1, num_layers=1, num_anchors=32, token_budget=512, lr=3e-3, max_steps=120,
                warmup=5, val_extracted=v['out'], eval_every=40, final_eval=False, progress=False, log_every=20)
    return d, res


@pytest.mark.slow
def test_the_walk_is_the_lossless_loops_tau(memorized):
    d, _ = memorized
    target, tok = load_target(str(TINY_TARGET)), load_tokenizer(str(TINY_TARGET))
    drafter = load_drafter(d / 'run/checkpoints/step-120', target)          # the last step: it has learnt the 12 replies by heart
    prompts = load_prompts(tok, d / 'few.jsonl', 12)
    ref = greedy_reference(target, prompts, 64)
    rows, xds = [json.loads(l) for l in open(d / 'few.jsonl')], ExtractedDataset(d / 'x')
    replies = [xds.get(i)['input_ids'][xds.get(i)['loss_mask']].tolist() for i in range(12)]
    same = [i for i in range(12) if ref['outputs'][i][:64] == replies[i][:64]]     # the stored reply is this very greedy decode
    assert len(same) >= 9, same
    e = evaluate(target, drafter, [prompts[i] for i in same], 64, reference=dict(ref, outputs=[ref['outputs'][i] for i in same],
                                                                                time_s=[ref['time_s'][i] for i in same]))
    sub = d / 'same.jsonl'; sub.write_text(''.join(json.dumps(rows[i]) + '\n' for i in same))
    xs = extract(data=str(sub), out=str(d / f'xs'), layer_ids=[4], progress=False)
    h = heldout_acceptance(drafter, ExtractedDataset(xs['out']), max_new_tokens=64)
    assert e['lossless'] and e['tau'] > 3, e['tau']
    assert abs(h['val_tau_walk'] - e['tau']) < 1e-9, (h['val_tau_walk'], e['tau'])
    assert abs(h['val_tau'] - e['tau']) < 0.25 * e['tau']                  # every position: close, not the same figure
    # the third reading: the same drafter served by llama.cpp (its own counters), the target converted to f16
    from dflash.engine import engine_check
    g = engine_check(TINY_TARGET, d / 'run/checkpoints/step-120', [prompts[i] for i in same], 64, threads=1)
    assert g['lossless'] and g['identical'] >= len(same) - 1 and abs(g['tau'] - e['tau']) < 0.1 * e['tau'], (g['tau'], e['tau'], g['per_prompt'])


@pytest.mark.slow
def test_a_run_publishes_its_best_drafter(memorized):
    d, res = memorized
    vals = [m for m in read_metrics(d / 'run') if 'val_tau' in m]
    best = None
    for m in vals: best = m if better(m, best) else best                  # by val_tau beyond its resolution, within it by the loss
    assert [m['step'] for m in vals] == [40, 80, 120] and res['best_step'] == best['step'] and res['val_tau'] == best['val_tau']
    a = load_drafter(d / 'run/drafter', load_target(str(TINY_TARGET)))
    assert heldout_acceptance(a, ExtractedDataset(d / 'v'))['val_tau'] == pytest.approx(best['val_tau'], abs=1e-6)
    assert f"the step-{best['step']} drafter, the best of the run" in (d / 'run/drafter/README.md').read_text()


@pytest.mark.slow
def test_a_run_reads_trees_beside_the_chain(memorized):
    "By default a run reads DDTree's trees of budgets 16 and 64 from the held-out forward: in metrics.jsonl, the calibration file, the plots."
    from dflash.core import read_jsonl
    from dflash.metrics import plot_dashboard, plot_calibration, TREE_CALIBRATION
    d, _ = memorized
    vals = [m for m in read_metrics(d / 'run') if 'val_tau' in m]
    for m in vals:
        t, se = m['val_tree_tau'], m['val_tree_tau_se']
        assert set(t) == set(se) == {'16', '64'} and 1 <= t['16'] <= t['64'] <= 16 and all(s > 0 for s in se.values())
        assert len(m['val_ece']) == 15 and 'val_calibration' not in m
    last = vals[-1]                                                        # a drafter that knows its replies: trees hold more of them
    assert last['val_tree_tau']['64'] > last['val_tau'], (last['val_tree_tau'], last['val_tau'])
    lines = read_jsonl(d / 'run' / TREE_CALIBRATION)
    assert [c['step'] for c in lines] == [40, 80, 120] and all(c['budget'] == 64 and len(c['spine']['nodes']) == 15 for c in lines)
    assert lines[-1]['spine']['nodes'][0] == last['val_blocks']            # every block's root reaches depth 1
    tw = next(a for a in plot_dashboard(d / 'run').axes if a.get_ylabel() == 'tau')
    labels = [l.get_label() for l in tw.lines]
    assert {'held-out tau (simulated)', 'held-out tree, budget 16', 'held-out tree, budget 64'} <= set(labels), labels
    plot_calibration(d / 'run')
    assert (d / 'run' / 'dashboard.png').exists() and (d / 'run' / 'tree_calibration.png').exists()


def test_best_by_a_budget_not_read_is_refused(tmp_path):
    "best_by names a tree the held-out reading does not build: refused when the job is built, before anything is written."
    from dflash.recipe import TrainConfig
    with pytest.raises(ValueError, match=r"best_by='val_tree_tau@32': the held-out reading measures trees of val_tree_budgets=16,64 only: add 32"):
        TrainConfig(out=str(tmp_path / 'run'), best_by='val_tree_tau@32')
    with pytest.raises(ValueError, match=r'val_tree_budgets=none only'):
        TrainConfig(out=str(tmp_path / 'run'), best_by='val_tree_tau@16', val_tree_budgets='none')
    assert TrainConfig(out=str(tmp_path / 'run'), best_by='val_tree_tau@32', val_tree_budgets='64,32').val_tree_budgets == [32, 64]
    assert not (tmp_path / 'run').exists()


@pytest.fixture(scope='module')
def heldout(tmp_path_factory):
    "The taps (layer 4) of 6 of the embedded target's replies to held-out prompts."
    d = tmp_path_factory.mktemp('heldout')
    (d / 'val.jsonl').write_text(''.join(open(HELDOUT_REGEN).readlines()[12:18]))
    return extract(data=str(d / 'val.jsonl'), out=str(d / 'v'), layer_ids=[4], progress=False)['out']


@pytest.mark.parametrize('arch', ['dflash', 'dflash2', 'dspark'])
def test_every_design_reads_its_tree_as_the_loop_grows_it(heldout, arch):
    """The held-out tree of every design is grown through its own `tree_expander`, as the loop's `tree_children` grows it: the tree's
    depth-0 spine (the root's best child) is the chain's first drafted token, so the spine's hit rate is the chain's slot-1 acceptance,
    and the tree of budget 1 reads 1 + it. DFlash2's selector is perturbed and DSpark's Markov head trained, so that neither design's
    children are its head's alone (a reading of the head without them parts from the chain)."""
    from dflash.model import DFlashDraftModel, drafter_config
    from dflash.dflash2 import DFlash2DraftModel
    from dflash.dspark import DSparkDraftModel, dspark_config
    from dflash.feed import collate
    target, tok = load_target(str(TINY_TARGET)), load_tokenizer(str(TINY_TARGET))
    target = target.float()
    torch.manual_seed(0)
    c = drafter_config(target.config, 1, 8, tok.mask_token_id, [4])
    model = {'dflash': lambda: DFlashDraftModel(c), 'dspark': lambda: DSparkDraftModel(dspark_config(target.config, 1, 8, tok.mask_token_id, [4])),
             'dflash2': lambda: DFlash2DraftModel.from_dflash(DFlashDraftModel(c))}[arch]().attach_target(target)
    xds = ExtractedDataset(heldout)
    rows = [xds[i] for i in range(6)]
    batch = collate(*(torch.cat([r[k] for r in rows]) for k in ('hidden_states', 'input_ids', 'loss_mask')), [len(r['input_ids']) for r in rows])
    opt, g = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator().manual_seed(0)
    for _ in range(20): model(*batch, num_anchors=32, generator=g, terms='ce').loss.backward(); opt.step(); opt.zero_grad()
    if arch == 'dflash2':
        with torch.no_grad(): model.candidate_selector.successor_codebook.normal_(0, 3.0)
    model.eval()
    r = heldout_acceptance(model, xds, max_samples=6, tree_budgets=[1, 4])
    spine = r['val_calibration']['spine']['measured'][0]
    assert r['val_accept'][0] > 0.05 and abs(spine - r['val_accept'][0]) < 1e-12, (r['val_accept'][0], spine)
    assert abs(r['val_tree_tau']['1'] - (1 + r['val_accept'][0])) < 1e-12
