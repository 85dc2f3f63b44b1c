"""Faults and bad input, job by job: each case asserts the exit status, the one-line message, and that nothing earlier was lost.
The console scripts' functions run in this process (the same `run_cli` the installed scripts run); a few run as real processes."""
import contextlib, hashlib, io, json, os, resource, shutil, signal, subprocess, sys
from pathlib import Path
import numpy as np, pytest, torch
from safetensors import safe_open
from dflash.core import TRAIN_DATA, HELDOUT_DATA, read_metrics
from dflash.data import prepare_cli, PrepareConfig
from dflash.extract import extract_cli, extract
from dflash.evaluate import evaluate_cli
from dflash.train import train_cli
from dflash.checkpoint import latest_checkpoint
from dflash.shards import read_manifest, update_manifest
from dflash.extracted import ExtractedDataset

BIN = Path(sys.executable).parent


def cli(fn, *args):
    "`(exit status, stderr)` of a console script's function run in this process."
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try: code = fn([str(a) for a in args])
        except SystemExit as e: code = e.code
    return code, err.getvalue()


def fails(fn, *args, msg, code=1):
    "The script exits with `code` (1; 2 for an option that does not parse) and a one-line reason containing `msg`."
    got, err = cli(fn, *args)
    assert got == code and msg in err, err[-2000:]
    first = next((l for l in err.splitlines() if not l.startswith('warning: ')), '')      # warnings said at the start may come first
    if code == 1: assert first.split(':')[0].startswith('dflash_') and ': error: ' in first, err
    return err


def tree(d):
    "{relative path: sha256} of every file under `d`: to show nothing earlier was lost or changed."
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).rglob('*')) if p.is_file()}


def kept(before, d):
    "Every file of `before` is still in `d` with the same bytes."
    now = tree(d)
    assert {k: v for k, v in before.items() if now.get(k) != v} == {}


@pytest.fixture(scope='module')
def w(tmp_path_factory, make_target, save_target):
    "A random 4-layer hybrid target, 40 conversations, their dataset, and a complete extraction of them."
    d = tmp_path_factory.mktemp('faults')
    save_target(make_target('qwen3_5'), d / 'target')
    (d / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    assert cli(prepare_cli, '--data', d / 'rows.jsonl', '--target', d / 'target', '--out', d / 'data')[0] == 0
    extract(target=str(d / 'target'), data=str(d / 'data'), out=str(d / 'x'), layer_ids=[1, 3], token_budget=512, shard_mb=0.02, progress=False)
    return d


TRAIN = ['--no-servable',   # taps 1, 3 of 4 layers: llama.cpp's limit, not what these tests check
         '--num-layers', '1', '--num-anchors', '8', '--token-budget', '512', '--lr', '3e-3', '--epochs', '1', '--log-every', '1',
         '--no-final-eval', '--no-progress', '--ckpt-every', '2', '--warmup', '0', '--min-lr-ratio', '0.1', '--weight-decay', '0']


# --- prepare -----------------------------------------------------------------------------------------------------

def test_prepare_missing_file(w, tmp_path): fails(prepare_cli, '--data', tmp_path / 'nope.jsonl', '--out', tmp_path / 'o', msg='data: no such file')

def test_prepare_negative_max_length(w, tmp_path): fails(prepare_cli, '--max-length', '-5', msg='max_length=-5: must be >= 2')

def test_prepare_zero_max_samples(w, tmp_path): fails(prepare_cli, '--max-samples', '0', msg='max_samples=0: must be >= 1')

def test_prepare_not_json(w, tmp_path):
    (tmp_path / 'bad.jsonl').write_text('{"id": 1}\n{oops\n')
    fails(prepare_cli, '--data', tmp_path / 'bad.jsonl', '--out', tmp_path / 'o', msg='bad.jsonl: not JSON or JSONL; first bad line 2')

def test_prepare_not_utf8(w, tmp_path):
    (tmp_path / 'latin.jsonl').write_bytes('{"text": "caf\xe9"}\n'.encode('latin-1'))
    fails(prepare_cli, '--data', tmp_path / 'latin.jsonl', '--out', tmp_path / 'o', msg='not UTF-8 text')

def test_prepare_no_usable_row_keeps_the_earlier_dataset(w, tmp_path):
    shutil.copytree(w / 'data', tmp_path / 'data'); before = tree(tmp_path / 'data')
    (tmp_path / 'bad.jsonl').write_text('{"messages": []}\n[1]\n')
    fails(prepare_cli, '--data', tmp_path / 'bad.jsonl', '--out', tmp_path / 'data', msg='none of its 2 rows is usable (1 no turns, 1 not an object)')
    kept(before, tmp_path / 'data')
    assert json.loads((tmp_path / 'data/report-failed.json').read_text())['counts'] == {'no turns': 1, 'not an object': 1}

def test_prepare_strict_keeps_the_earlier_dataset(w, tmp_path):
    shutil.copytree(w / 'data', tmp_path / 'data'); before = tree(tmp_path / 'data')
    (tmp_path / 'mixed.jsonl').write_text(open(TRAIN_DATA).readline() + '{"messages": [{"role": "robot", "content": "x"}]}\n')
    fails(prepare_cli, '--data', tmp_path / 'mixed.jsonl', '--out', tmp_path / 'data', '--strict', msg='1 bad rows (strict mode)')
    kept(before, tmp_path / 'data')

def test_prepare_skips_and_counts_empty_replies(w, tmp_path):
    "An empty assistant reply would train on a lone end-of-turn token: skipped and counted by default, kept with the flag."
    rows = [json.loads(l) for l in open(TRAIN_DATA).readlines()[:5]]
    next(t for t in rows[2]['conversations'] if t['from'] == 'gpt')['value'] = '  '
    (tmp_path / 'r.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert cli(prepare_cli, '--data', tmp_path / 'r.jsonl', '--target', w / 'target', '--out', tmp_path / 'd')[0] == 0
    rep = json.loads((tmp_path / 'd/report.json').read_text())
    assert rep['kept'] == 4 and 'empty reply' in json.dumps(rep)
    assert cli(prepare_cli, '--data', tmp_path / 'r.jsonl', '--target', w / 'target', '--out', tmp_path / 'k', '--keep-empty-replies')[0] == 0
    assert json.loads((tmp_path / 'k/report.json').read_text())['kept'] == 5

def test_prepare_out_is_a_file(w, tmp_path):
    (tmp_path / 'f').write_text('x')
    fails(prepare_cli, '--out', tmp_path / 'f', msg='is a file, not a directory')

def test_prepare_refuses_another_jobs_out(w):
    before = tree(w / 'x')
    fails(prepare_cli, '--data', w / 'rows.jsonl', '--out', w / 'x', msg='holds the results of another job (ExtractConfig)')
    kept(before, w / 'x')

def test_prepare_missing_target(w, tmp_path): fails(prepare_cli, '--target', tmp_path / 'no-model', msg=f'no such directory: {tmp_path}/no-model')

def test_prepare_python_api_checks_types():
    with pytest.raises(ValueError, match="strict='yes': must be true or false"): PrepareConfig(strict='yes')


# --- extract -----------------------------------------------------------------------------------------------------

def test_extract_gpus_not_a_number(w): fails(extract_cli, '--gpus', 'four', msg="argument --gpus: invalid integer value: 'four'", code=2)

def test_extract_gpus_without_gpus(w, tmp_path):
    if torch.cuda.is_available(): pytest.skip('this machine has GPUs')
    fails(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', tmp_path / 'x', '--gpus', '2', msg='gpus=2, but torch sees 0 CUDA devices')

def test_extract_bad_token_budget(w): fails(extract_cli, '--token-budget', 'lots', msg="token_budget='lots': must be a number of tokens or 'auto'")

def test_extract_bad_store_dtype(w): fails(extract_cli, '--store-dtype', 'int4', msg="store_dtype='int4': must be one of")

def test_extract_layer_out_of_range(w, tmp_path):
    fails(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', tmp_path / 'x', '--layer-ids', '1,99',
          msg='layer_ids [99] out of range for a target of 4 decoder layers')

def _copy(w, tmp_path):
    shutil.copytree(w / 'x', tmp_path / 'x', ignore=shutil.ignore_patterns('dataset'))
    (tmp_path / 'x' / 'dataset').symlink_to(w / 'data')            # not used: the run reads `data`
    return tmp_path / 'x'

def _resume(w, x):
    return cli(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', x, '--layer-ids', '1,3', '--token-budget', '512',
               '--shard-mb', '0.02', '--no-progress')

@pytest.mark.parametrize('damage', ['overwrite-bytes', 'truncate', 'delete'])
def test_extract_resume_redoes_a_damaged_shard(w, tmp_path, damage):
    "A shard damaged after it was listed (same size, shorter, or gone) is found on resume and redone: the result is bit-identical."
    x = _copy(w, tmp_path); m = read_manifest(x); f = x / m['shards'][1]['file']
    if damage == 'overwrite-bytes':
        with open(f, 'r+b') as fh: fh.seek(f.stat().st_size // 2); fh.write(b'\x7f' * 64)
    elif damage == 'truncate': os.truncate(f, f.stat().st_size // 2)
    else: f.unlink()
    code, err = _resume(w, x)
    assert code == 0 and m['shards'][1]['file'] in err and {'overwrite-bytes': 'corrupt', 'truncate': 'truncated', 'delete': 'missing'}[damage] in err
    a, b = ExtractedDataset(x, verify=True), ExtractedDataset(w / 'x')
    assert read_manifest(x)['complete'] and a.verify_all() and all(torch.equal(a[i]['hidden_states'], b[i]['hidden_states']) for i in range(len(b)))

def test_extract_refuses_other_layers_and_keeps_the_shards(w, tmp_path):
    x = _copy(w, tmp_path); before = tree(x)
    fails(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', x, '--layer-ids', '1,2', msg='layer_ids=[1, 3] (now [1, 2])')
    kept(before, x)

def test_extract_refused_for_another_dataset_changes_nothing(w, tmp_path):
    "An out holding the extraction of another file is refused before the new file is tokenized: its dataset stays as it was."
    x = tmp_path / 'x'
    assert cli(extract_cli, '--target', w / 'target', '--data', w / 'rows.jsonl', '--out', x, '--layer-ids', '1', '--no-progress')[0] == 0
    before = tree(x)
    (tmp_path / 'other.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[40:60]))
    fails(extract_cli, '--target', w / 'target', '--data', tmp_path / 'other.jsonl', '--out', x, '--layer-ids', '1', '--no-progress',
          msg=f'out: {x} holds the extraction of another dataset')
    assert tree(x) == before

def test_extract_overwrite_sets_the_earlier_one_aside(w, tmp_path):
    x = _copy(w, tmp_path); shards = tree(x); shards = {k: v for k, v in shards.items() if k.startswith('shard-')}
    code, _ = cli(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', x, '--layer-ids', '2', '--overwrite', '--no-progress')
    prev = next(x.glob('previous-*'))
    assert code == 0 and read_manifest(x)['layer_ids'] == [2] and read_manifest(prev)['layer_ids'] == [1, 3]
    kept(shards, prev)

def test_extract_refuses_a_training_out(w, tmp_path):
    (tmp_path / 'run' / 'checkpoints').mkdir(parents=True)
    fails(extract_cli, '--target', w / 'target', '--data', w / 'data', '--out', tmp_path / 'run', msg='holds the results of another job (TrainConfig)')

def test_extract_success_exits_0_as_a_process(w, tmp_path):
    r = subprocess.run([str(BIN / 'dflash_extract'), '--target', str(w / 'target'), '--data', str(w / 'data'), '--out', str(tmp_path / 'x'),
                        '--layer-ids', '1', '--max-samples', '4', '--no-progress'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])['num_samples'] == 4

def test_extract_full_disk_keeps_nothing_half_written_and_resumes(w, tmp_path):
    "Files capped at 64 KB (as a full disk would stop them): exit 1 naming the file, no partial shard; resumed with room: identical."
    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    args = ['--target', w / 'target', '--data', w / 'data', '--out', tmp_path / 'x', '--layer-ids', '1,3', '--token-budget', '512',
            '--shard-mb', '0.5', '--no-progress']
    r = subprocess.run([str(BIN / 'dflash_extract'), *map(str, args)], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert r.returncode == 1 and 'File too large' in r.stderr and 'shard-w0-00000.safetensors.tmp' in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / 'x').glob('*.tmp')) and not read_manifest(tmp_path / 'x')['complete']
    assert cli(extract_cli, *args)[0] == 0
    a, b = ExtractedDataset(tmp_path / 'x'), ExtractedDataset(w / 'x')
    assert all(torch.equal(a[i]['hidden_states'], b[i]['hidden_states']) for i in range(len(b)))


# --- train -------------------------------------------------------------------------------------------------------

def test_empty_dataset_refused_up_front_by_extract_and_train(w, tmp_path):
    "A dataset with no samples: extraction and online training each say so before any model loads or rank starts."
    (tmp_path / 'p.jsonl').write_text(json.dumps({'messages': [{'role': 'user', 'content': 'hi'}]}) + '\n')
    assert cli(prepare_cli, '--data', tmp_path / 'p.jsonl', '--target', w / 'target', '--out', tmp_path / 'd', '--allow-empty')[0] == 0
    fails(extract_cli, '--target', w / 'target', '--data', tmp_path / 'd', '--out', tmp_path / 'x', msg='holds no samples')
    assert not (tmp_path / 'x/manifest.json').exists() or not read_manifest(tmp_path / 'x')['complete']
    fails(train_cli, '--target', w / 'target', '--data', tmp_path / 'd', '--out', tmp_path / 'o', '--targets', '1', '--drafters', '1', *TRAIN,
          msg='holds no samples: nothing to train on')
    assert not (tmp_path / 'o/logs').exists()

def test_train_block_size_1(w): fails(train_cli, '--block-size', '1', msg='block_size=1: must be >= 2')

def test_train_zero_lr(w): fails(train_cli, '--lr', '0', msg='lr=0.0: must be > 0')

def test_train_zero_epochs(w): fails(train_cli, '--epochs', '0', msg='epochs=0.0: must be > 0')

def test_train_zero_anchors(w): fails(train_cli, '--num-anchors', '0', msg='num_anchors=0: must be >= 1')

def test_train_auto_split_needs_two_ranks(w): fails(train_cli, '--targets', 'auto', '--ranks', '1', msg='ranks=1: must be >= 2')

def test_train_online_zero_targets(w): fails(train_cli, '--targets', '0', msg='targets=0: must be >= 1')

def test_train_online_missing_data(w, tmp_path): fails(train_cli, '--data', tmp_path / 'none.jsonl', msg='data: no such file or directory')

def test_train_extracted_is_not_an_extraction(w): fails(train_cli, '--extracted', w / 'data', msg='is not an extraction (no manifest.json)')

def test_train_missing_eval_file(w, tmp_path):
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', '--eval-data',
          tmp_path / 'mt.jsonl', '--max-steps', '1', *TRAIN[:-10], msg='mt.jsonl')

def test_train_bad_eval_file_is_refused_before_training(w, tmp_path):
    "An eval file with no usable prompt stops the run before any step: no checkpoint, no drafter."
    (tmp_path / 'bad.jsonl').write_text(json.dumps({'messages': [{'role': 'assistant', 'content': 'hi'}]}) + '\n')
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *[t for t in TRAIN if t != '--no-final-eval'],
          '--eval-data', tmp_path / 'bad.jsonl', '--eval-prompts', '1', msg='bad.jsonl row 1: no turns')
    assert not (tmp_path / 'o/checkpoints').exists() and not (tmp_path / 'o/drafter').exists()

def test_train_refuses_a_corrupt_shard_and_saves_nothing(w, tmp_path):
    "Offline training checks each shard's sha256 before using it: a corrupt one stops the run, named, with how to repair it."
    x = _copy(w, tmp_path); f = x / read_manifest(x)['shards'][0]['file']
    with open(f, 'r+b') as fh: fh.seek(f.stat().st_size // 2); fh.write(b'\x7f' * 64)
    fails(train_cli, '--target', w / 'target', '--extracted', x, '--out', tmp_path / 'o', '--drafters', '1', *TRAIN,
          msg=f'{f}: corrupt (sha256 differs from the manifest). Resume the extraction')
    assert not (tmp_path / 'o/drafter').exists()

def test_train_takes_a_requested_prefix_and_refuses_an_interrupted_extraction(w, tmp_path):
    "An extraction of the first 5 samples (max_samples) is a finished job and trains; one a kill interrupted is refused."
    extract(target=str(w / 'target'), data=str(w / 'data'), out=str(tmp_path / 'x'), layer_ids=[1], max_samples=5, progress=False)
    code, err = cli(train_cli, '--target', w / 'target', '--extracted', tmp_path / 'x', '--out', tmp_path / 'o', '--drafters', '1', *TRAIN)
    assert code == 0 and (tmp_path / 'o/drafter/config.json').exists(), err[-2000:]
    update_manifest(tmp_path / 'x', lambda m: m.update(complete=False))   # as a run killed mid-way leaves it
    fails(train_cli, '--target', w / 'target', '--extracted', tmp_path / 'x', '--out', tmp_path / 'o2', '--drafters', '1', *TRAIN,
          msg='the extraction is not complete')

def test_train_on_prompts_only_points_to_regenerate(w, tmp_path):
    "A file of prompts without replies: the message says to have the target answer them with dflash_regenerate."
    rows = [json.loads(l) for l in open(TRAIN_DATA).readlines()[:6]]
    prompts = tmp_path / 'prompts.jsonl'
    prompts.write_text(''.join(json.dumps(dict(id=r['id'], conversations=r['conversations'][:1])) + '\n' for r in rows))
    err = fails(train_cli, '--target', w / 'target', '--data', prompts, '--out', tmp_path / 'o', '--targets', '1', '--drafters', '1', *TRAIN,
                msg='6 no assistant turn')
    assert f'dflash_regenerate --target {w / "target"} --data {prompts} --out {tmp_path / "prompts-regen.jsonl"}' in err

def test_train_mask_token_chosen_before_launch_and_never_in_the_data(w, tmp_path):
    """A target with no mask token and no spare embedding row (as SmolLM2): the mask is a declared special token the template
    and the data never use, chosen and said before any rank starts; an id the data holds is refused up front."""
    t = tmp_path / 'full'; shutil.copytree(w / 'target', t)
    tc = json.loads((t / 'tokenizer_config.json').read_text()); tc.pop('mask_token', None); (t / 'tokenizer_config.json').write_text(json.dumps(tc))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(t)
    from dflash.taps import load_target_config, text_config
    assert text_config(load_target_config(t)).vocab_size == len(tok), 'no spare row'
    out = io.StringIO()
    with contextlib.redirect_stdout(out): code = train_cli(list(map(str, ['--target', t, '--data', w / 'rows.jsonl', '--out', tmp_path / 'o',
                                                                        '--targets', '1', '--drafters', '1', *TRAIN])))
    assert code in (0, None), out.getvalue()[-3000:]
    m = json.loads((tmp_path / 'o/drafter/config.json').read_text())['dflash_config']['mask_token_id']
    assert m == tok.convert_tokens_to_ids('<|mask|>') and 'no mask token and no spare embedding row' in out.getvalue()
    from dflash.data import TokenizedDataset
    assert not np.isin(m, np.asarray(TokenizedDataset.load(tmp_path / 'o/dataset').input_ids)).any()
    eos = tok.eos_token_id
    fails(train_cli, '--target', t, '--data', w / 'rows.jsonl', '--out', tmp_path / 'o2', '--targets', '1', '--drafters', '1', *TRAIN,
          '--mask-token-id', eos, msg=f'mask_token_id {eos} (given) occurs in the training data')
    assert not (tmp_path / 'o2/logs').exists(), 'refused before any rank started'

@pytest.fixture(scope='module')
def nan_target(w, make_target, save_target):
    "The faults' target with a NaN weight in layer 0: every state it taps is NaN."
    bad = make_target('qwen3_5')
    with torch.no_grad(): bad.model.layers[0].mlp.down_proj.weight.fill_(float('nan'))
    return save_target(bad, w / 'nan-target')

def test_extract_nonfinite_target_states_stop_naming_sample_and_layer(w, nan_target, tmp_path):
    "A NaN weight in layer 0: extraction stops at its first batch naming the layer and the sample; nothing is marked complete."
    code, err = cli(extract_cli, '--target', nan_target, '--data', w / 'data', '--out', tmp_path / 'x', '--layer-ids', '1,3', '--no-progress')
    assert code == 1 and 'dflash_extract: error: the target produced non-finite hidden states at layer 1 for sample' in err, err[-2000:]
    assert not read_manifest(tmp_path / 'x')['complete']

def test_extract_refuses_states_past_the_store_dtype(w, make_target, save_target, tmp_path):
    """A target whose states pass fp16's range (as Gemma 3's reach about 1e5): `--store-dtype fp16` stops at the first batch naming the
    tap and the value, before an infinity is stored; bf16 holds them."""
    big = make_target('qwen3_5')
    with torch.no_grad(): big.model.embed_tokens.weight.mul_(1e7)            # the residual stream carries it: about 1e5 at every tap
    t = save_target(big, tmp_path / 'big-target')
    code, err = cli(extract_cli, '--target', t, '--data', w / 'data', '--out', tmp_path / 'x', '--layer-ids', '1,3', '--store-dtype', 'fp16', '--no-progress')
    assert code == 1 and "store_dtype=float16: the target's hidden states at layer 1 reach" in err and 'store them in bf16 or fp8' in err, err[-2000:]
    assert not read_manifest(tmp_path / 'x')['complete']
    code, err = cli(extract_cli, '--target', t, '--data', w / 'data', '--out', tmp_path / 'y', '--layer-ids', '1,3', '--store-dtype', 'bf16', '--no-progress')
    assert code == 0 and read_manifest(tmp_path / 'y')['complete'], err[-2000:]

def test_train_online_nonfinite_target_states_named_on_the_top_line(w, nan_target, tmp_path):
    "Online, the target rank stops with the reason, and the command's one line carries it (not just an exit code)."
    err = fails(train_cli, '--target', nan_target, '--data', w / 'data', '--out', tmp_path / 'o', '--targets', '1', '--drafters', '1', *TRAIN,
                msg='rank 0 (target 0) failed: NonFiniteStates: the target produced non-finite hidden states at layer')
    assert not (tmp_path / 'o/drafter').exists()

@pytest.fixture(scope='module')
def run(w, tmp_path_factory):
    "A finished offline run with checkpoints, to resume and restart."
    out = tmp_path_factory.mktemp('run') / 'o'
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', out, '--drafters', '1', *TRAIN)[0] == 0
    return out

def test_train_full_disk_at_a_checkpoint_names_the_file_and_keeps_the_last(w, tmp_path):
    "Files capped (as a full disk stops them) while a checkpoint is written: the message says so and names the file; step 2 stays."
    args = ['--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *TRAIN, '--max-steps', '2']
    assert cli(train_cli, *args)[0] == 0
    before = tree(tmp_path / 'o/checkpoints')
    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (96 << 10, 96 << 10))
    more = [*args[:-1], '4', '--resume', '--resume-changes', 'max_steps', '--ckpt-every', '2']
    r = subprocess.run([str(BIN / 'dflash_train'), *map(str, more)], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert r.returncode == 1 and 'the disk is full (or the file size limit was hit) writing' in r.stderr, r.stderr[-2000:]
    assert '.step-4.tmp/' in r.stderr and 'The last complete checkpoint' in r.stderr
    kept(before, tmp_path / 'o/checkpoints'); assert latest_checkpoint(tmp_path / 'o').name == 'step-2'
    assert not list((tmp_path / 'o/checkpoints').glob('.step-*'))

def test_train_fresh_run_refuses_an_earlier_one(w, run):
    before = tree(run)
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', run, '--drafters', '1', *TRAIN,
          msg='holds an earlier run (metrics.jsonl, checkpoints, drafter, result.json, run.json): resume=True continues it, overwrite=True')
    kept(before, run)

def test_train_overwrite_keeps_the_earlier_run_aside(w, run, tmp_path):
    shutil.copytree(run, tmp_path / 'o'); before = {k: v for k, v in tree(tmp_path / 'o').items() if k.startswith(('checkpoints', 'drafter'))}
    assert cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *TRAIN, '--overwrite')[0] == 0
    kept(before, next((tmp_path / 'o').glob('previous-*')))

@pytest.mark.parametrize('change,value', [('lr', '1e-3'), ('block-size', '8'), ('seed', '3'), ('num-layers', '2')])
def test_train_resume_refuses_changed_settings(w, run, tmp_path, change, value):
    shutil.copytree(run, tmp_path / 'o'); before = tree(tmp_path / 'o')
    args = [a for a in TRAIN]
    if f'--{change}' in args: args[args.index(f'--{change}') + 1] = value
    else: args += [f'--{change}', value]
    key = change.replace('-', '_')
    fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *args, '--resume',
          msg=f"resume: {tmp_path / 'o'}/checkpoints/step-")
    kept(before, tmp_path / 'o')
    if key == 'num_layers':                                     # a new shape is not offered as an override, and is refused whole
        fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *args, '--resume',
              '--resume-changes', key, msg="num_layers=2: the drafter's shape differs, so the run cannot continue")
        kept(before, tmp_path / 'o'); assert tree(tmp_path / 'o') == before
    else:
        code, err = cli(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', tmp_path / 'o', '--drafters', '1', *args,
                        '--resume', '--resume-changes', key)
        assert code == 0
        ev = [m for m in read_metrics(tmp_path / 'o') if m.get('event') == 'resume'][-1]
        assert list(ev['changed']) == [key]

def test_train_refuses_an_extractions_out(w): fails(train_cli, '--target', w / 'target', '--extracted', w / 'x', '--out', w / 'x', '--drafters', '1',
                                                    *TRAIN, msg='holds the results of another job (ExtractConfig)')


# --- evaluate ----------------------------------------------------------------------------------------------------

def test_evaluate_drafter_not_a_checkpoint(w, tmp_path): fails(evaluate_cli, '--drafter', tmp_path, msg='is not a drafter checkpoint (no config.json)')

def test_evaluate_drafter_for_another_target(w, run, tmp_path):
    fails(evaluate_cli, '--drafter', run / 'drafter', '--out', tmp_path / 'e', msg='the drafter does not fit the target')

def test_evaluate_no_usable_prompts(w, run, tmp_path):
    (tmp_path / 'p.jsonl').write_text(json.dumps({'messages': [{'role': 'assistant', 'content': 'hi'}]}) + '\n')
    fails(evaluate_cli, '--target', w / 'target', '--drafter', run / 'drafter', '--eval-data', tmp_path / 'p.jsonl', '--out', tmp_path / 'e',
          msg='p.jsonl row 1: no turns')

def test_evaluate_checks_every_file_before_evaluating(w, run, tmp_path):
    "good,empty: the empty file is named before the good one is evaluated (nothing is written)."
    (tmp_path / 'empty.jsonl').write_text('')
    fails(evaluate_cli, '--target', w / 'target', '--drafter', run / 'drafter', '--eval-data', f'{HELDOUT_DATA},{tmp_path / "empty.jsonl"}',
          '--out', tmp_path / 'e', '--num-prompts', '1', msg='empty.jsonl: the file is empty')
    assert not (tmp_path / 'e/results.json').exists() and not (tmp_path / 'e/config.json').exists()

def test_evaluate_zero_prompts(w): fails(evaluate_cli, '--num-prompts', '0', msg='num_prompts=0: must be >= 1')
