"Stock targets by hub id, offline, as a user runs them: prepare, extract, train offline and online, evaluate, publish, reload."
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from safetensors import safe_open
from dflash.core import TRAIN_DATA, HELDOUT_DATA
from dflash.model import DFlashDraftModel
from conftest import STOCK

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not

BIN = Path(sys.executable).parent


def run(cache, prog, *args, timeout=600):
    "Run a console script as a user would, offline, with the test's Hugging Face cache; returns the completed process."
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_HUB_CACHE': str(cache), 'OMP_NUM_THREADS': '1'}
    return subprocess.run([str(BIN / prog), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def ok(r):
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
    d = tmp_path_factory.mktemp('rows')
    (d / 'train.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:40]))
    return d / 'train.jsonl'


SMALL = ['--max-steps', '3', '--token-budget', '1024', '--eval-prompts', '1', '--eval-max-new-tokens', '8', '--no-progress', '--log-every', '1']


@pytest.mark.slow
@pytest.mark.parametrize('repo', list(STOCK))
def test_stock_target_by_hub_id_end_to_end(repo, hub_cache, rows, tok, tmp_path):
    "No mask token, spare embedding rows, a template of its own, loaded by id from the cache with HF_HUB_OFFLINE=1."
    d = tmp_path
    ok(run(hub_cache, 'dflash_prepare', '--target', repo, '--data', rows, '--out', d / 'data'))
    r = ok(run(hub_cache, 'dflash_extract', '--target', repo, '--data', d / 'data', '--out', d / 'x', '--token-budget', '1024', '--no-progress'))
    x = json.loads(r.stdout.strip().splitlines()[-1])
    assert x['complete'] and x['layer_ids'] == [1, 2, 3, 4, 5], 'five taps by the rule for an 8-layer target'
    manifest = json.loads((d / 'x/manifest.json').read_text())
    assert manifest['target'] == repo and manifest['complete']
    # offline: the recipe's 5 drafter layers read the extraction's 5 taps
    off = ok(run(hub_cache, 'dflash_train', '--target', repo, '--extracted', d / 'x', '--out', d / 'off', '--drafters', '1', *SMALL))
    assert 'num_layers          = 5   (recipe' in off.stdout and 'Lossless: every one' in off.stdout
    # online: one target rank feeding one drafter rank
    ok(run(hub_cache, 'dflash_train', '--target', repo, '--data', d / 'data', '--out', d / 'on', '--targets', '1', '--drafters', '1', *SMALL))
    res = json.loads((d / 'on/result.json').read_text())
    assert res['step'] == 3 and res['lossless']
    # the published drafter
    pub = d / 'on/drafter'
    cfg = json.loads((pub / 'config.json').read_text())
    assert cfg['target_model'] == repo and cfg['target_revision'] == ('1' if 'qwen3-' in repo else '2') * 40
    assert cfg['dflash_config']['mask_token_id'] == len(tok), 'the first spare embedding row: the tokenizer has no mask token'
    assert cfg['dflash_config']['target_layer_ids'] == [1, 2, 3, 4, 5] and cfg['rope_theta'] == cfg['rope_parameters']['rope_theta']
    with safe_open(pub / 'model.safetensors', 'pt') as f: assert f.get_tensor('fc.weight').dtype == torch.bfloat16
    card = (pub / 'README.md').read_text()
    assert repo in card and '[1, 2, 3, 4, 5]' in card and 'speculative-draft-model-path' in card and 'dflash_evaluate' in card
    m = DFlashDraftModel.from_pretrained(pub)
    assert m.mask_token_id == len(tok) and m.block_size == 16 and len(m.layers) == 5
    # evaluation by id, on the user's own prompt file and the held-out split
    asks = d / 'asks.jsonl'
    asks.write_text(json.dumps({'messages': [{'role': 'user', 'content': 'Convert 3 km to m.'}]}) + '\n')
    ev = ok(run(hub_cache, 'dflash_evaluate', '--target', repo, '--drafter', pub, '--eval-data', f'{asks},{HELDOUT_DATA}',
                '--num-prompts', '1', '--max-new-tokens', '8', '--out', d / 'eval'))
    assert 'asks.jsonl' in ev.stdout and 'sharegpt-heldout' in ev.stdout and 'Lossless: every one of the 4' in ev.stdout


def test_missing_targets_say_what_is_missing(hub_cache, tmp_path):
    "A path that does not exist, and an id the cache lacks (offline), each fail in one line that says so."
    r = run(hub_cache, 'dflash_prepare', '--target', tmp_path / 'no-such-model')
    assert r.returncode == 1 and f'no such directory: {tmp_path / "no-such-model"}' in r.stderr
    r = run(hub_cache, 'dflash_prepare', '--target', 'acme/never-downloaded')
    assert r.returncode == 1 and 'acme/never-downloaded: not a local directory, and not in the Hugging Face cache' in r.stderr
    assert str(hub_cache) in r.stderr


def test_offline_training_refuses_another_targets_extraction(hub_cache, rows, tmp_path):
    "An extraction made from one target is refused by training for another, naming both."
    d = tmp_path
    ok(run(hub_cache, 'dflash_extract', '--target', 'acme/qwen3-stock', '--data', rows, '--out', d / 'x', '--no-progress'))
    r = run(hub_cache, 'dflash_train', '--target', 'acme/qwen3.5-stock', '--extracted', d / 'x', '--out', d / 'off', '--drafters', '1', *SMALL)
    assert r.returncode == 1 and 'was extracted from acme/qwen3-stock, whose config differs from the target acme/qwen3.5-stock' in r.stderr
