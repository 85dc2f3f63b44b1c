"""Inputs that belong to another drafter, target or tap, and files tied to a drafter's weights: every job that reads an extraction,
a profile or a temperatures file checks it as training does (`dflash.inputs.check_inputs`, `check_extraction`), before anything runs."""
import json, os, shutil, warnings
import pytest, torch
from transformers import AutoConfig, AutoModelForCausalLM
from dflash.core import TRAIN_DATA
from dflash.data import prepare_cli
from dflash.extract import extract
from dflash.engine import engine_cli
from dflash.treecal import treecal_cli
from dflash.evaluate import load_drafter, evaluate_cli
from dflash.inputs import check_inputs
from dflash.shards import read_manifest
from dflash.extracted import check_extraction
from dflash.speedup import write_profile
from dflash.train import train_cli
from dflash.tree import write_tree_temperatures, read_tree_temperatures, TREE_T_FILE
from dflash.taps import load_target
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter
from dflash.extract import extract_cli
from dflash.store import Store
from test_faults import cli, fails, tree

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
    assert check_inputs(w / 'ck', w / 'A', w / 'xA')[1].layer_ids == [1, 2]
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


# --- issue 59: a location is read one way by every job (`core.parse_url`) ---------------------------------------------------------


def test_a_url_that_names_no_store_is_refused_by_every_job(w, tmp_path, monkeypatch):
    "`s3://` (no bucket) was a local folder named `s3:`; `http://` was retried as unreachable; a URL a Path made is `s3:/...`: each is named at once."
    monkeypatch.chdir(tmp_path)
    fails(extract_cli, '--target', w / 'A', '--data', w / 'data-A', '--out', 's3://', msg="out='s3://': no bucket after s3://")
    fails(extract_cli, '--target', w / 'A', '--data', w / 'data-A', '--out', 'http://127.0.0.1:9/bkt/x',
          msg="out='http://127.0.0.1:9/bkt/x': http(s) is not a store dflash reads and writes: for an S3-compatible server there, give "
              's3://BUCKET/PREFIX with AWS_ENDPOINT_URL=http://127.0.0.1:9')
    fails(train_cli, '--target', w / 'A', '--extracted', 's3://', '--out', tmp_path / 'run', *TRAIN, msg="extracted='s3://': no bucket")
    fails(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', tmp_path / 'run', '--cache-dir', 's3://bkt/c', *TRAIN,
          msg="cache_dir='s3://bkt/c': a local path, not a store URL")
    fails(treecal_cli, '--drafter', w / 'ck', '--target', w / 'A', '--extracted', 's3:/bkt/ext', msg="its '//' was lost (a path joined it?): write s3://bkt/ext")
    fails(engine_cli, '--drafter', w / 'ck', '--target', w / 'A', '--profile', '--val-extracted', 's3://', msg="val_extracted='s3://': no bucket")
    assert sorted(p.name for p in tmp_path.iterdir()) == []                  # no folder named s3: (nor a run)


def _bucket(w, tmp_path, name='xA'):
    "The extraction `name` of `w` in a store (a file:// one), as `dflash_extract --out URL` leaves it: its URL."
    shutil.copytree(w / name, tmp_path / 'bucket' / name)
    return Store(f'file://{tmp_path}/bucket/{name}').url


def test_a_store_extraction_is_read_by_every_job_and_leaves_no_copy(w, tmp_path, monkeypatch):
    "select_taps, dflash_treecal --extracted and dflash_engine --val-extracted take a store URL as training does; the shards they fetch are let go."
    from dflash.peers import select_taps
    from dflash.engine import EngineConfig
    monkeypatch.setenv('DFLASH_CACHE', str(tmp_path / 'cache'))
    url = _bucket(w, tmp_path)
    assert read_manifest(select_taps(url, tmp_path / 'x1', [1]))['layer_ids'] == [1]
    assert EngineConfig(drafter=str(w / 'ck'), val_extracted=url + '/', profile=True).val_extracted == url
    fails(engine_cli, '--drafter', w / 'ck', '--target', w / 'A', '--profile', '--val-extracted', url + '-none',
          msg=f'val_extracted: {url}-none is not an extraction (no manifest.json)')
    ck = tmp_path / 'ck'; shutil.copytree(w / 'ck', ck)
    code, err = cli(treecal_cli, '--drafter', ck, '--target', w / 'A', '--extracted', url, '--max-blocks', '16', '--sweeps', '1', '--budgets', '4')
    assert code == 0 and (ck / TREE_T_FILE).exists(), err[-2000:]
    left = [p for p in (tmp_path / 'cache').rglob('*') if p.is_file() and 'store-index' not in p.parts and 'sha256' not in p.parts]
    assert left == [], left                                                  # no shard of the store left in the cache


def test_a_staging_folder_that_holds_a_local_extraction_is_refused(w, tmp_path):
    "Before: --staging-dir at a finished local extraction uploaded its shard and deleted it there, exit 0. Now: refused, the folder untouched."
    local = tmp_path / 'local'; shutil.copytree(w / 'xA', local)
    before = tree(local)
    fails(extract_cli, '--target', w / 'A', '--data', w / 'data-A', '--out', f'file://{tmp_path}/bucket/x', '--staging-dir', local,
          '--layer-ids', '1,2', '--token-budget', '512', '--no-progress', msg=f'staging_dir: {local} holds files that are not staging of file://')
    assert tree(local) == before and not (tmp_path / 'bucket' / 'x' / 'manifest.json').exists()


def test_an_extraction_into_a_prefix_another_one_writes_is_refused(w, tmp_path):
    "Two extractions into one prefix (other staging folders): the second is refused while the first's lease is fresh; a stale one is taken over."
    import json as _json, time as _time
    from dflash.mirror import LEASE
    url = f'file://{tmp_path}/bucket/x'
    args = ['--target', w / 'A', '--data', w / 'data-A', '--out', url, '--layer-ids', '1,2', '--token-budget', '512', '--no-progress',
            '--staging-dir', tmp_path / 'stage']
    (tmp_path / 'bucket' / 'x').mkdir(parents=True)
    lease = dict(id='other', host='another-host', pid=1, staging='/elsewhere/stage', time=_time.time())
    (tmp_path / 'bucket' / 'x' / LEASE).write_text(_json.dumps(lease))
    fails(extract_cli, *args, msg=f'{url}: another extraction is writing into it (on another-host, pid 1, staging /elsewhere/stage')
    assert not (tmp_path / 'bucket' / 'x' / 'manifest.json').exists()
    (tmp_path / 'bucket' / 'x' / LEASE).write_text(_json.dumps(dict(lease, time=_time.time() - 3600)))   # not renewed for an hour
    code, err = cli(extract_cli, *args)
    assert code == 0 and Store(url).read_json('manifest.json')['complete'] and not (tmp_path / 'bucket' / 'x' / LEASE).exists(), err[-2000:]


@pytest.mark.parametrize('value,msg', [('cuda:99', "DFLASH_DEVICE='cuda:99': "), ('junk', "DFLASH_DEVICE='junk': not a device torch knows"),
                                       ('CPU', "DFLASH_DEVICE='CPU': not a device torch knows"), ('meta', "DFLASH_DEVICE='meta': jobs do not run on meta")])
def test_dflash_device_is_checked_before_anything_is_written(w, tmp_path, monkeypatch, value, msg):
    monkeypatch.setenv('DFLASH_DEVICE', value)
    fails(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '1', msg=msg)
    fails(extract_cli, '--target', w / 'A', '--data', w / 'data-A', '--out', tmp_path / 'x', msg=msg)
    assert not (tmp_path / 'run').exists() and not (tmp_path / 'x').exists()


# --- issue 59: the weights' fingerprint sees every byte -----------------------------------------------------------------------

def test_one_value_changed_in_one_tensor_is_other_weights(w, tmp_path):
    "Before: the fingerprint read about 1 MiB of a file and missed a changed tensor before the tap; training took the other weights' states."
    from safetensors.torch import load_file, save_file
    from dflash.taps import weights_sha256, file_fingerprint
    one = tmp_path / 'A-one'; shutil.copytree(w / 'A', one)
    sd = load_file(one / 'model.safetensors')
    k = next(k for k in sd if 'layers.0.' in k and sd[k].dim() == 2)
    sd[k][3, 5] += 0.5
    save_file(sd, one / 'model.safetensors', metadata={'format': 'pt'})
    assert weights_sha256(one) != weights_sha256(w / 'A')
    with pytest.raises(ValueError, match="whose weights differ from the target"): check_extraction(w / 'xA', one)
    fails(train_cli, '--target', one, '--extracted', w / 'xA', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '1',
          msg='whose weights differ from the target')
    f = one / 'model.safetensors'
    import dflash.taps as taps
    real, taps.file_sha256 = taps.file_sha256, lambda p: (_ for _ in ()).throw(AssertionError(f'{p} read again'))
    try: assert file_fingerprint(f) == real(f)                               # remembered by size and mtime: not read again
    finally: taps.file_sha256 = real


# --- issue 59: a served form's vocabulary maps, checked when it loads and before a GGUF is written -------------------------------

@pytest.fixture(scope='module')
def served(w, tok):
    "A served form of the drafter `ck` over 64 target ids, and a factory of copies with its config or tensors altered."
    from safetensors.torch import load_file, save_file
    from dflash.draft_vocab import DFlashVocabDraftModel
    ids = torch.arange(10, 74) * 3 % len(tok)
    p = save_drafter(DFlashVocabDraftModel.from_full(load_drafter(w / 'ck', load_target(w / 'A', dtype=torch.float32)), ids), w / 'served')
    def altered(name, config=None, **tensors):
        q = w / f'served-{name}'
        if not q.exists():
            q.mkdir(); c = {**json.loads((p / 'config.json').read_text()), **(config or {})}
            (q / 'config.json').write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
            save_file({**load_file(p / 'model.safetensors'), **tensors}, q / 'model.safetensors', metadata={'format': 'pt'})
        return q
    return p, ids.sort().values, altered


def _d2t(served, at, to):
    "The served form's d2t with draft id `at` mapped to the target id `to`."
    p, ids, _ = served
    d = ids - torch.arange(len(ids)); d[at] = to - at
    return d


@pytest.mark.parametrize('case,msg', [
    ('past', 'd2t maps draft id 3 to 5000, not a token of 0..'),             # 2: torch's "index 5000 is out of bounds", naming nothing
    ('minus', 'd2t maps draft id 0 to -1'),                                  # 3: torch read -1 as the last token, "Lossless"
    ('twice', 'draft ids to a token another one maps to'),                   # 15
    ('short', 'd2t holds [63] entries and its head 64 rows, where draft_vocab_size says 64'),   # 16
    ('size', 'where draft_vocab_size says 60'),                              # 16
    ('t2d', 't2d marks 0 tokens, not the 64 d2t maps to'),                   # 17
    ('lost', 'has no draft_vocab_size: it would load as the full form')])    # 18
def test_a_served_vocabulary_with_bad_maps_is_refused_naming_the_file(w, served, tmp_path, case, msg):
    p, ids, altered = served
    V = json.loads((p / 'config.json').read_text())['vocab_size']
    q = {'past': lambda: altered('past', d2t=_d2t(served, 3, 5000)), 'minus': lambda: altered('minus', d2t=_d2t(served, 0, -1)),
         'twice': lambda: altered('twice', d2t=_d2t(served, 1, int(ids[0]))), 'short': lambda: altered('short', d2t=(ids - torch.arange(64))[:63]),
         'size': lambda: altered('size', config=dict(draft_vocab_size=60)), 't2d': lambda: altered('t2d', t2d=torch.zeros(V, dtype=torch.bool)),
         'lost': lambda: altered('lost', config=dict(draft_vocab_size=None))}[case]()
    err = fails(evaluate_cli, '--target', w / 'A', '--drafter', q, '--num-prompts', '1', '--max-new-tokens', '4', '--out', tmp_path / 'e', msg=msg)
    assert str(q / 'model.safetensors') in err and not (tmp_path / 'e').exists()


def test_a_served_vocabulary_is_checked_before_llamacpp_or_a_gguf_sees_it(w, served, tmp_path):
    "4: llama.cpp aborted the process (GGML_ASSERT) on a -1 or out-of-range d2t; add_gguf_head wrote the ids unchecked."
    from dflash.convert import add_gguf_head
    p, ids, altered = served
    for q in (altered('past', d2t=_d2t(served, 3, 5000)), altered('minus', d2t=_d2t(served, 0, -1))):
        fails(engine_cli, '--drafter', q, '--target', w / 'A', '--out', tmp_path / 'e', msg='d2t maps draft id')
        with pytest.raises(ValueError, match='d2t maps draft id'): add_gguf_head(tmp_path / 'drafter.gguf', q)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_permuted_d2t_is_refused_against_the_targets_head(w, served, tmp_path):
    "17: a permuted d2t keeps every count right: its own head's rows, held against the target head's, tell (tau fell to 1.00 without a reason)."
    p, ids, altered = served
    q = altered('perm', d2t=ids[torch.randperm(64, generator=torch.Generator().manual_seed(0))] - torch.arange(64))
    code, err = cli(evaluate_cli, '--target', w / 'A', '--drafter', q, '--num-prompts', '1', '--max-new-tokens', '4', '--out', tmp_path / 'e')
    assert code == 1 and f"dflash_evaluate: error: {q}: its own head's row" in err, err[-2000:]     # once the target is there to compare with
    assert load_drafter(p, load_target(w / 'A', dtype=torch.float32)).config.draft_vocab_size == 64    # the right one loads


# --- issue 59: a peer's checkpoint is checked, tensor by tensor -------------------------------------------------------------------

def test_import_drafter_checks_every_tensor_against_its_config(w, tmp_path):
    "7, 24, 25, 26: a layer the weights lack, another hidden size, a truncated file, a config without taps: refused naming the file."
    from safetensors.torch import load_file, save_file
    from dflash.peers import import_drafter
    from dflash.taps import weights_sha256
    c = json.loads((w / 'ck' / 'config.json').read_text()); sd = load_file(w / 'ck' / 'model.safetensors')
    other = DFlashDraftModel(drafter_config(AutoConfig.from_pretrained(w / 'B'), 1, 4, 3, [1, 2])).state_dict()   # hidden 32
    def peer(name, config, tensors=None, raw=None):
        d = tmp_path / name; d.mkdir(); (d / 'config.json').write_text(json.dumps(config))
        if raw is not None: (d / 'model.safetensors').write_bytes(raw)
        else: save_file(tensors, d / 'model.safetensors')
        return d
    for d, msg in [(peer('two', {**c, 'num_hidden_layers': 2, 'layer_types': ['full_attention'] * 2}, sd),
                    'the config (num_hidden_layers 2, hidden_size 64, taps [1, 2]): layers.1.* is missing'),
                   (peer('hidden', c, other), 'layers.0.self_attn.q_proj.weight is [32, 32], the config makes it [64, 64]'),
                   (peer('cut', c, raw=(w / 'ck' / 'model.safetensors').read_bytes()[:4000]), 'not a readable safetensors file'),
                   (peer('notaps', {**c, 'dflash_config': {'mask_token_id': 3}}, sd), "has no 'target_layer_ids'")]:
        with pytest.raises(ValueError) as e: import_drafter(d, tmp_path / 'out', w / 'A')
        assert msg in str(e.value) and str(d) in str(e.value) and not (tmp_path / 'out').exists(), str(e.value)
    back = import_drafter(peer('ok', c, sd), tmp_path / 'out', w / 'A')
    assert json.loads((back / 'config.json').read_text())['target_weights_sha256'] == weights_sha256(w / 'A')


def test_to_specforge_writes_each_samples_rows_only(w, tmp_path):
    "8: with dtype=None each .ckpt held its sample's whole shard (a slice of a memory map saves its storage): 43 MB for 1.08 MB of states."
    from dflash.peers import to_specforge
    from dflash.extracted import ExtractedDataset
    xds = ExtractedDataset(w / 'xA')
    r = to_specforge(xds, tmp_path / 'sf')
    files = list((tmp_path / 'sf').rglob('*.ckpt'))
    assert r['written'] == len(files) > 0
    states = sum(xds.get(int(f.stem.split('_')[1]))['hidden_states'].nbytes for f in files)
    assert sum(f.stat().st_size for f in files) < 1.5 * states + 4096 * len(files)


# --- issue 59: settings checked and marked against what the run reads -------------------------------------------------------------

def test_store_settings_and_masks_are_marked_where_a_run_never_reads_them(w, tmp_path):
    "13, 22: cache_dir and cache_gb with a local extraction, mask_mb on a CPU: marked (not read: ...), and warned when given."
    from dflash.recipe import TrainConfig
    line = lambda d, k: next(l for l in d.splitlines() if l.strip().startswith(k + ' '))
    local, store = TrainConfig(extracted=str(w / 'xA')).describe(), TrainConfig(extracted=_bucket(w, tmp_path)).describe()
    for k in ('cache_dir', 'cache_gb'):
        assert '(not read: only with extracted=URL (an object store))' in line(local, k) and 'not read' not in line(store, k)
    assert '(not read: only with a GPU (flex attention; a CPU builds no mask))' in line(local, 'mask_mb')
    code, err = cli(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', tmp_path / 'run', *TRAIN, '--max-steps', '1', '--no-servable',
                    '--cache-gb', '2', '--mask-mb', '0.001')
    assert code == 0, err[-2000:]
    assert 'warning: cache_gb=2.0 has no effect: it is read only with extracted=URL' in err and 'warning: mask_mb=0.001 has no effect' in err


def test_q_gb_and_mask_mb_are_held_against_the_device(monkeypatch):
    "21: --q-gb 1e9 was taken without a word; 22: --mask-mb below one anchor's mask was printed as held, on a GPU that builds one anchor whole."
    import dflash.recipe as recipe
    with pytest.raises(ValueError, match=r'q_gb=1e\+09: more than the [\d,.]+ GiB of memory of the cpu'): recipe.TrainConfig(q_gb=1e9)
    monkeypatch.setattr(recipe, 'rank_device', lambda c, r: torch.device('cuda', 0))        # a GPU's rank, without one here
    monkeypatch.setattr(recipe, 'device_memory', lambda d: 80 << 30)
    with pytest.raises(ValueError, match=r"mask_mb=0.001: one anchor's flex mask at token_budget=1024 and block_size=16 takes 0.2 MiB"):
        recipe.TrainConfig(mask_mb=0.001)
    with pytest.raises(ValueError, match=r'q_gb=100: more than the 80.0 GiB of memory of the cuda'): recipe.TrainConfig(q_gb=100)
    assert recipe.TrainConfig(mask_mb=1).mask_mb == 1


# --- issue 59: the target's weights a drafter was trained for, recorded and compared ----------------------------------------------

def test_a_published_drafter_records_its_targets_weights_and_warns_on_others(w, tmp_path):
    "20: the published config.json records the weights' fingerprint; evaluating with other weights warns. 28: --train-vocab past the vocabulary."
    from dflash.taps import weights_sha256
    run = tmp_path / 'run'
    code, err = cli(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', run, *TRAIN, '--max-steps', '2', '--no-servable',
                    '--train-vocab', '999999')
    assert code == 0, err[-2000:]
    assert json.loads((run / 'drafter' / 'config.json').read_text())['target_weights_sha256'] == weights_sha256(w / 'A')
    assert "warning: train_vocab=999999 is not below the target's vocabulary" in err and not (run / 'drafter-vocab').exists()
    args = ['--drafter', run / 'drafter', '--num-prompts', '1', '--max-new-tokens', '4']
    code, err = cli(evaluate_cli, '--target', w / 'A-tuned', *args, '--out', tmp_path / 'e1')
    assert code == 0 and 'has other weights (the same config: fine-tuned or replaced)' in err, err[-2000:]
    code, err = cli(evaluate_cli, '--target', w / 'A', *args, '--out', tmp_path / 'e2')
    assert code == 0 and 'other weights' not in err, err[-2000:]


def test_a_resume_onto_other_target_weights_sets_the_kept_best_aside(w, tmp_path):
    "19: the kept best was trained for, and measured on the states of, the old weights: a resume that changes them sets it aside."
    (tmp_path / 'val.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[16:20]))
    extract(target=str(w / 'A-tuned'), data=str(w / 'data-A'), out=str(tmp_path / 'xT'), layer_ids=[1, 2], token_budget=512, progress=False)
    run, train = tmp_path / 'run', [a for a in TRAIN if a not in ('--val-data', 'none')]
    args = ['--out', run, *train, '--val-data', tmp_path / 'val.jsonl', '--no-servable', '--ckpt-every', '2', '--eval-every', '2']
    code, err = cli(train_cli, '--target', w / 'A', '--extracted', w / 'xA', *args, '--max-steps', '2')
    assert code == 0 and json.loads((run / 'checkpoints' / 'best' / 'BEST.json').read_text())['step'] == 2, err[-2000:]
    code, err = cli(train_cli, '--target', w / 'A-tuned', '--extracted', tmp_path / 'xT', *args, '--max-steps', '4', '--resume',
                    '--resume-changes', 'target_weights,max_steps')
    assert code == 0, err[-2000:]
    assert json.loads((run / 'checkpoints' / 'best.other-weights' / 'BEST.json').read_text())['step'] == 2
    assert json.loads((run / 'checkpoints' / 'best' / 'BEST.json').read_text())['step'] == 4        # measured with the new weights only


def test_a_validation_split_in_a_store_leaves_no_copy_in_the_cache(w, tmp_path, monkeypatch):
    "14: every run with --val-extracted s3://... left a copy of the held-out shards in the store cache, never deleted."
    monkeypatch.setenv('DFLASH_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'val.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[16:20]))
    extract(target=str(w / 'A'), data=str(tmp_path / 'val.jsonl'), out=str(tmp_path / 'bucket' / 'val'), layer_ids=[1, 2], token_budget=512, progress=False)
    run, train = tmp_path / 'run', [a for a in TRAIN if a not in ('--val-data', 'none')]
    code, err = cli(train_cli, '--target', w / 'A', '--extracted', w / 'xA', '--out', run, *train, '--val-extracted', f'file://{tmp_path}/bucket/val',
                    '--no-servable', '--max-steps', '2', '--eval-every', '2')
    assert code == 0 and (run / 'checkpoints' / 'best' / 'BEST.json').exists(), err[-2000:]
    assert [p for p in (tmp_path / 'cache' / 'store-cache').rglob('*') if p.is_file()] == []


def test_a_fingerprint_an_earlier_dflash_recorded_is_compared_as_it_was_made(w, tmp_path):
    "Extractions and checkpoints made before the fingerprint saw every byte keep working with their target, and still refuse another's."
    from dflash.taps import _sampled_sha256
    x = tmp_path / 'x'; shutil.copytree(w / 'xA', x)
    m = read_manifest(x); m['target_weights_sha256'] = _sampled_sha256(w / 'A'); (x / 'manifest.json').write_text(json.dumps(m))
    assert check_extraction(x, w / 'A') is not None
    with pytest.raises(ValueError, match='whose weights differ from the target'): check_extraction(x, w / 'A-tuned')
    r = extract(target=str(w / 'A'), data=str(w / 'data-A'), out=str(x), layer_ids=[1, 2], token_budget=512, progress=False)   # resumed
    assert r['complete'] and r['skipped'] == r['num_samples'] == 16
