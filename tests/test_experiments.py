"""The experiment notebooks (nbs/experiments/) are jobs too: each checks every parameter in the cell after its parameters,
before its first step, naming the parameter and what is allowed; and it writes under `out` unless asked to write elsewhere."""
import hashlib, json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest
from dflash.core import ROOT

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not

PAPERMILL = Path(sys.executable).parent / 'papermill'
NB = ROOT / 'nbs' / 'experiments'
FIGURE = ROOT / 'assets' / 'real-data-curve.png'                    # README's figure
REGEN = ROOT / 'data' / 'real' / 'sharegpt-train-regen.jsonl'       # the real demo's committed training data


def sha(p): return hashlib.sha256(Path(p).read_bytes()).hexdigest()

def snapshot(d):
    "Every file under `d`, with its sha256."
    return {str(p.relative_to(d)): sha(p) for p in sorted(Path(d).rglob('*')) if p.is_file()}

def papermill(name, cwd, *params, timeout=300):
    "Run experiment `name` with papermill in `cwd` (`-p` pairs in `params`): the result, and the executed notebook's code cells."
    nb = cwd / 'out.ipynb'
    r = subprocess.run([str(PAPERMILL), str(NB / f'{name}.ipynb'), str(nb), *map(str, params), '--cwd', str(cwd)],
                       capture_output=True, text=True, timeout=timeout, env={**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1'})
    cells = [c for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code'] if nb.exists() else []
    return r, cells

def failed_cell(cells):
    return next(i for i, c in enumerate(cells) if any(o.get('output_type') == 'error' for o in c.get('outputs', [])))

def text_of(cell): return ''.join(''.join(o.get('text', '')) for o in cell.get('outputs', []))

def check_cell(cells): return next(c for c in cells if 'from_params(globals())' in ''.join(c['source']))


def fake_demo(d):
    "The real demo's out, as far as the data curve reads it before training: an extraction of 40 conversations."
    (d / 'demo' / 'extract').mkdir(parents=True)
    (d / 'demo' / 'extract' / 'manifest.json').write_text(json.dumps(dict(num_samples=40, target='none', complete=True)))

def fake_run(d):
    "A finished training run validated with `val_extracted`, an extraction whose source file is gone."
    run, vx = d / 'run', d / 'val-extract'
    (run / 'drafter').mkdir(parents=True); vx.mkdir()
    (run / 'drafter' / 'model.safetensors').write_bytes(b'')
    (run / 'config.json').write_text(json.dumps(dict(job='TrainConfig', config=dict(
        target=str(d / 'no-target'), val_data=None, val_extracted=str(vx), eval_max_new_tokens=16, layer_ids=[1]))))
    (vx / 'manifest.json').write_text(json.dumps(dict(num_samples=4)))
    (vx / 'config.json').write_text(json.dumps(dict(job='ExtractConfig', config=dict(data=str(d / 'gone.jsonl')))))

def fake_drafter(d):
    "A drafter checkpoint as far as the engine and tree experiments read it before any model loads: its config, block 8."
    (d / 'drafter').mkdir()
    (d / 'drafter' / 'config.json').write_text(json.dumps(dict(architectures=['DFlashDraftModel'], block_size=8)))


def fake_served(d):
    "A run's two published drafters as far as served_vocab.ipynb reads them before any model loads: their configs, block 8."
    fake_drafter(d); (d / 'drafter-vocab').mkdir(); (d / 'drafter-vocab' / 'config.json').write_text((d / 'drafter' / 'config.json').read_text())


# Issue 31's cases 8 and 19: (notebook, its -p pairs, what it must say, what the case needs in its folder first)
BAD = {
    'data_curve-sizes-above-the-extraction': ('data_curve', ['demo', 'demo', 'sizes', '8,100', 'out', 'out'],
                                              ['sizes=8,100: 100 must be in [1, 40]', 'the extraction demo/extract holds 40 conversations'], fake_demo),
    'real_demo-optimizer': ('real_demo', ['optimizer', 'sgd', 'out', 'out'], ["optimizer='sgd': must be one of 'adamw', 'muon'"], None),
    'real_demo-loss-terms': ('real_demo', ['loss_terms', 'ce:0.1,l2:0.9', 'out', 'out'], ["loss term 'l2' in 'ce:0.1,l2:0.9': one of ce, kl, tv, l1, lk"], None),
    'real_demo-engine-lengths': ('real_demo', ['engine_lengths', '1,9', 'out', 'out'], ['engine_lengths: [9] not in 1..7 (block_size=8 drafts 7)'], None),
    'real_demo-conversations-0': ('real_demo', ['conversations', 0, 'out', 'out'],
                                  ['conversations=0: must be in [1, 2112]', 'sharegpt-train-regen.jsonl holds 2112 conversations'], None),
    'real_demo-conversations-3000': ('real_demo', ['conversations', 3000, 'out', 'out'],
                                     ['conversations=3000: must be in [1, 2112]', 'sharegpt-train-regen.jsonl holds 2112 conversations'], None),
    'window_tau-window-0': ('window_tau', ['window', 0, 'out', 'out'], ['window=0: must be >= 1'], None),
    'levers-mistyped-setting': ('levers', ['settings', 'baseline,vocab4kk', 'out', 'out'],
                                ["settings: 'vocab4kk' (in 'vocab4kk') is not a setting: the settings are baseline, vocab4k,"], None),
    'warm_start-steps-0': ('warm_start', ['steps', 0, 'out', 'out'], ['steps=0: must be >= 1'], None),
    'heldout_vs_loop-val_extracted-source-gone': ('heldout_vs_loop', ['run', 'run', 'out', 'out'],
                                                  ['data: the run run names no validation file', 'whose source file is unknown or gone', 'give data='],
                                                  fake_run),
    'engine_sweep-n_max-above-the-block': ('engine_sweep', ['drafter', 'drafter', 'n_max', '1,9', 'out', 'out'],
                                           ['n_max: [9] not in 1..7 (the drafter drafts at most block - 1)'], fake_drafter),
    'engine_sweep-outtype': ('engine_sweep', ['drafter', 'drafter', 'outtypes', 'f16,q4', 'out', 'out'], ["outtypes: ['q4'] not in"], fake_drafter),
    'tree_budget-budget-0': ('tree_budget', ['drafter', 'drafter', 'budgets', '0,4', 'out', 'out'], ["budgets: ['0'] are not node counts >= 1"],
                             fake_drafter),
    'tree_budget-budget-above-the-bound': ('tree_budget', ['drafter', 'drafter', 'budgets', '16,100000', 'out', 'out'],
                                           ['budgets=100000: a DDTree budget is a number of nodes in 0..1024'], fake_drafter),
    'tree_budget-no-drafter': ('tree_budget', ['out', 'out'], ['drafter: None is not a drafter checkpoint'], None),
    'served_vocab-no-train': ('served_vocab', ['rounds', 2], ["train: give a run's folder"], None),
    'served_vocab-no-served-form': ('served_vocab', ['train', '.'], ['drafter-vocab is not a drafter: a run with train_vocab publishes both'], fake_drafter),
    'served_vocab-n_max-above-the-block': ('served_vocab', ['train', '.', 'n_max', 9], ['n_max: 9 is more than this drafter drafts (7)'], fake_served),
    'peers-unknown-cell': ('peers', ['cells', 'dflash,eagle3', 'out', 'out'], ["cells: ['eagle3'] unknown; known: dflash, specforge-recipe"], None),
    'peers-probe-as-long-as-the-run': ('peers', ['wall_s', 100, 'probe_s', 100, 'out', 'out'], ['probe_s: 100', 'must be less than wall_s'], None),
    'peers-seeds': ('peers', ['seeds', '0,one', 'out', 'out'], ["seeds: '0,one' is not a comma-separated list of integers"], None),
    'store-unknown-target': ('store', ['targets', 'tiny,gpt2', 'out', 'out'], ["targets='tiny,gpt2': 'gpt2' is not one of tiny, smollm2"], None),
    'store-steps-below-4': ('store', ['steps', 2, 'out', 'out'], ['steps=2: must be >= 4'], None),
    'tree_budget-lone-temperature': ('tree_budget', ['drafter', 'drafter', 'temperatures', '0.0001', 'out', 'out'],     # a number, not a string
                                     ["temperatures: ['0.0001']: 0, or at least 0.001"], fake_drafter)}

@pytest.fixture(scope='module')
def refused(tmp_path_factory):
    """Every case of BAD, run two at a time (papermill spends most of a run starting a kernel): {case: (its folder, the files there
    before, the committed figure's and data's sha256 before, the papermill result, the executed code cells)}."""
    def one(case):
        name, params, _, prepare = BAD[case]
        d = tmp_path_factory.mktemp(case)
        if prepare: prepare(d)
        before = snapshot(d), sha(FIGURE), sha(REGEN)
        return (d, *before, *papermill(name, d, *[x for i, v in enumerate(params) for x in (['-p', v] if i % 2 == 0 else [v])]))
    tmp_path_factory.getbasetemp()          # made once, here: two threads making it at once race (rm_rf, mkdir: FileExistsError)
    with ThreadPoolExecutor(2) as ex: return dict(zip(BAD, ex.map(one, BAD)))

@pytest.mark.parametrize('case', list(BAD))
def test_a_bad_parameter_stops_at_the_check(case, refused):
    """A bad parameter: a nonzero exit, a message naming the parameter and what is allowed, raised in the check cell (the one after
    the parameters) with no cell after it run; nothing written (no out), the committed figure and data unchanged."""
    d, files, figure, regen, r, cells = refused[case]
    said = r.stdout + r.stderr
    assert r.returncode != 0, said[-3000:]
    for m in BAD[case][2]: assert m in said, (m, said[-3000:])
    i = failed_cell(cells)
    assert cells[i] is check_cell(cells), 'the notebook fails in its check cell'
    assert not any(c.get('execution_count') for c in cells[i + 1:]), 'no cell after the check ran'
    assert snapshot(d) == {**files, 'out.ipynb': sha(d / 'out.ipynb')}, 'nothing was written, nothing changed'
    assert sha(FIGURE) == figure and sha(REGEN) == regen


def test_data_curve_plot_goes_under_out(tmp_path):
    "Case 7: the data curve's plot lands in out (README's figure in assets/ is written only when plot= asks for it)."
    out, before = tmp_path / 'curve', sha(FIGURE)
    out.mkdir()
    pt = lambda t: dict(tau=t, by_file={'sharegpt-prompts-heldout.jsonl': t - .1, 'humaneval-prompts.jsonl': t + .1}, lossless=True)
    (out / 'curve.json').write_text(json.dumps(dict(ngram=1.3, points={'8': pt(1.5), '32': pt(1.9)}, settings=dict(epochs=2),
                                                    eval=dict(files='a,b', prompts=2, max_new_tokens=8))))
    r, _ = papermill('data_curve', tmp_path, '-p', 'replot', 'True', '-p', 'out', out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (out / 'real-data-curve.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert sha(FIGURE) == before, 'the committed figure is unchanged'
    assert set(snapshot(tmp_path)) == {'out.ipynb', 'curve/curve.json', 'curve/real-data-curve.png'}


def test_heldout_vs_loop_on_a_run_validated_with_val_extracted(tmp_path):
    """A run validated with val_extracted (its val_data None) is measured on the file that extraction was made from, end to end
    (a 4-step offline run of the embedded target); the results go to out, the run is left as it was."""
    from dflash.extract import extract
    from dflash.train import train
    held = ROOT / 'data' / 'sharegpt-heldout-regen.jsonl'
    for data, x in ((ROOT / 'data' / 'sharegpt-train-regen.jsonl', 'x'), (held, 'vx')):
        extract(data=str(data), out=str(tmp_path / x), max_samples=8, num_draft_layers=1, progress=False)
    run = tmp_path / 'run'
    train(out=str(run), extracted=str(tmp_path / 'x'), val_extracted=str(tmp_path / 'vx'), eval_every=2, max_steps=4, ckpt_every=2, keep=5,
          final_eval=False, progress=False)
    assert json.loads((run / 'config.json').read_text())['config']['val_data'] is None
    before = snapshot(run)
    r, cells = papermill('heldout_vs_loop', tmp_path, '-p', 'run', 'run', '-p', 'prompts', 2, '-p', 'max_new_tokens', 8, '-p', 'out', 'agree')
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"data           = '{held}'   (the file the run's val_extracted" in text_of(check_cell(cells)), text_of(check_cell(cells))
    a = json.loads((tmp_path / 'agree' / 'agreement.json').read_text())
    assert {x['file'] for x in a['rows']} == {held.name} and [x['drafter'] for x in a['rows']] == ['step-2', 'step-4', 'drafter'] and a['lossless']
    assert (tmp_path / 'agree' / 'agreement.png').exists() and snapshot(run) == before
