"""llama.cpp serving our drafters (the xllamacpp wheel, in process): `dflash_engine` on a small target llama.cpp loads, and drafters
it cannot serve refused before serving or before training, naming the setting."""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
import transformers as T
from dflash.core import TRAIN_DATA
from dflash.gguf import smollm2
from dflash.model import DFlashDraftModel, drafter_config
from dflash.publish import save_drafter

BIN = Path(sys.executable).parent
ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1'}


@pytest.fixture(scope='module')
def w(tmp_path_factory):
    "A random 4-layer Qwen3 target with SmolLM2's tokenizer (a pre-tokenizer llama.cpp knows), a drafter for it, two prompts."
    d = tmp_path_factory.mktemp('engine')
    tok = T.AutoTokenizer.from_pretrained(smollm2())
    torch.manual_seed(0)
    m = T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    m.save_pretrained(d / 'target'); tok.save_pretrained(d / 'target')
    for name, taps in (('drafter', [1, 2]), ('last', [1, 3])):
        save_drafter(DFlashDraftModel(drafter_config(m.config, 1, 8, 16, taps)), d / name)
    (d / 'asks.jsonl').write_text(''.join(json.dumps({'messages': [{'role': 'user', 'content': q}]}) + '\n' for q in ('What is 12 + 30?', 'Name a color.')))
    return d


def engine(*args):
    return subprocess.run([str(BIN / 'dflash_engine'), *map(str, args)], capture_output=True, text=True, timeout=600, env=ENV)


def test_dflash_engine_reports_the_engines_own_figures_beside_ours(w, tmp_path):
    "From a shell: converted once, served, counted; greedy output with the drafter the engine's own plain output; our loop beside it."
    r = engine('--drafter', w / 'drafter', '--target', w / 'target', '--eval-data', w / 'asks.jsonl', '--max-new-tokens', 12, '--reps', 2,
               '--threads', 1, '--out', tmp_path / 'eng')
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / 'eng' / 'engine.json').read_text())['results'][str(w / 'asks.jsonl')]
    e = res['engine']
    assert e['lossless'] and e['kind'] == 'dflash' and e['n_max'] == 7 and e['drafts'] > 0 and e['drafted'] <= 7 * e['drafts']
    assert e['tau'] == 1 + e['accepted'] / e['drafts'] and len(e['per_prompt']) == 2 and e['reps'] == 2 and res['ours']['lossless']
    assert 'llama-server -m' in e['commands']['server'] and '--spec-type draft-dflash --spec-draft-n-max 7' in e['commands']['server']
    assert Path(e['target_gguf']).is_file() and 'engine tau' in r.stdout


def test_the_engine_refuses_a_drafter_it_cannot_serve(w, tmp_path):
    "A tap on the target's last layer would abort llama.cpp's process: refused before anything is served, naming the setting."
    r = engine('--drafter', w / 'last', '--target', w / 'target', '--eval-data', w / 'asks.jsonl', '--out', tmp_path / 'eng')
    assert r.returncode == 1 and "layer_ids=[1, 3]: llama.cpp reads a tap as the input of the layer after it" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / 'eng' / 'engine.json').exists()


def test_training_says_what_llamacpp_cannot_serve_before_it_starts(w, tmp_path):
    "A tap on the last layer is refused before any step (servable unset or true); --no-servable trains it all the same."
    (tmp_path / 'few.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:6]))
    args = ['--target', w / 'target', '--data', tmp_path / 'few.jsonl', '--num-layers', 1, '--layer-ids', '1,3', '--targets', 1, '--max-steps', 1,
            '--no-final-eval', '--no-progress', '--token-budget', 512, '--num-anchors', 4]
    r = subprocess.run([str(BIN / 'dflash_train'), *map(str, args), '--out', tmp_path / 'a'], capture_output=True, text=True,
                       timeout=600, env=ENV)
    assert r.returncode == 1 and 'layer_ids=[1, 3]: llama.cpp reads a tap' in r.stderr and not (tmp_path / 'a' / 'checkpoints').exists(), r.stderr[-2000:]
    from dflash.resolve import resolve
    from dflash.recipe import TrainConfig
    assert '--no-servable' in r.stderr, r.stderr[-2000:]
    cfg = resolve(TrainConfig(target=str(w / 'target'), data=str(tmp_path / 'few.jsonl'), num_layers=1, layer_ids=[1, 3], out=str(tmp_path / 'b'),
                              servable=False)).config
    assert cfg.layer_ids == [1, 3] and not any('llama.cpp' in x for x in cfg.warnings)


def test_training_ends_with_the_engines_figures(w, tmp_path):
    "A run on a target llama.cpp serves (xllamacpp installed, a small target): the published drafter is served at the end, its figures in result.json, metrics.jsonl and the card."
    from dflash.extract import extract
    from dflash.core import read_metrics
    (tmp_path / 'few.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:8]))
    x = extract(target=str(w / 'target'), data=str(tmp_path / 'few.jsonl'), out=str(tmp_path / 'x'), layer_ids=[1, 2], token_budget=512, progress=False)
    r = subprocess.run([str(BIN / 'dflash_train'), '--target', str(w / 'target'), '--extracted', x['out'], '--out', str(tmp_path / 'run'), '--num-layers', '1',
                        '--block-size', '8', '--max-steps', '2', '--num-anchors', '4', '--token-budget', '512', '--eval-data', str(w / 'asks.jsonl'),
                        '--eval-prompts', '2', '--eval-max-new-tokens', '8', '--no-progress'], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / 'run' / 'result.json').read_text())
    assert res['engine_lossless'] and res['engine_tau'] >= 1 and 'engine_error' not in res
    assert [m for m in read_metrics(tmp_path / 'run') if 'engine_tau' in m][0]['engine_tau'] == res['engine_tau']
    card = (tmp_path / 'run' / 'drafter' / 'README.md').read_text()
    assert '| the same drafter served by llama.cpp (its counters) |' in card and 'Served by llama.cpp (the xllamacpp' in card and 'llama-server -m' in card


def test_ctrl_c_stops_the_engine_at_once(w, tmp_path):
    """SIGINT while llama.cpp decodes a long request: exit 130 and 'interrupted' at once, not when the request or the run ends.
    Started as a script's background job is (SIGINT ignored, which Python keeps), the case in which dflash_engine ran on to rc 0."""
    import signal, time
    p = subprocess.Popen([str(BIN / 'dflash_engine'), '--drafter', str(w / 'drafter'), '--target', str(w / 'target'), '--eval-data', str(w / 'asks.jsonl'),
                          '--max-new-tokens', '3500', '--reps', '1', '--threads', '1', '--no-ours', '--out', str(tmp_path / 'eng')],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        seen = ''
        for line in p.stdout:                                   # until both servers run; the requests follow at once
            seen += line
            if line.startswith('llama.cpp: serving'): break
        assert 'llama.cpp: serving' in seen, seen[-2000:] + p.stderr.read()[-2000:]
        time.sleep(3.5)                                         # the plain decode (~3 s) done, inside the speculative one (~30 s)
        t0 = time.time(); p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
        took, err = time.time() - t0, p.stderr.read()
    finally:
        if p.poll() is None: p.kill(); p.wait()
    print(f'stopped {took:.2f} s after SIGINT')
    assert rc == 130 and 'dflash_engine: interrupted' in err and took < 2, (rc, took, err[-2000:])
    assert not (tmp_path / 'eng' / 'engine.json').exists()


def vllm_tool():
    "tools/vllm_check.py, imported by path (its top level needs no vLLM)."
    import importlib.util
    spec = importlib.util.spec_from_file_location('vllm_check', Path(__file__).resolve().parents[1] / 'tools' / 'vllm_check.py')
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m


def test_vllm_check_serves_each_design_with_its_method():
    "DFlash, DFlash2 and XPress as vLLM's 'dflash' drafting block - 1 tokens, DSpark as 'dspark' drafting all B; anything else refused."
    from dflash.designs import DESIGNS
    v = vllm_tool()
    assert set(v.METHODS) == {d.architecture for d in DESIGNS.values()}          # every design this project trains, and no other
    assert v.speculative({'architectures': ['DFlashDraftModel'], 'block_size': 16}) == ('dflash', 15)
    assert v.speculative({'architectures': ['DFlash2DraftModel'], 'block_size': 8}) == ('dflash', 7)
    assert v.speculative({'architectures': ['Qwen3DSparkModel'], 'block_size': 7}) == ('dspark', 7)
    assert v.speculative({'architectures': ['Qwen3XPressModel'], 'block_size': 16}) == ('dflash', 15)
    with pytest.raises(ValueError, match='not a drafter this check serves'): v.speculative({'architectures': ['Qwen3ForCausalLM'], 'block_size': 16})


def test_make_vllm_check_looks_at_the_drafter_before_any_venv(w, tmp_path):
    "A DRAFTER that is no drafter (here a target) stops `make vllm-check` at once, before vLLM's venv (or the project's) is built."
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(['make', '-s', '-C', str(root), 'vllm-check', f"DRAFTER={w / 'target'}", f"VLLM_VENV={tmp_path / 'vv'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "architectures ['Qwen3ForCausalLM']: not a drafter this check serves" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / 'vv').exists() and 'pip' not in r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(root / 'tools' / 'vllm_check.py'), str(w / 'drafter'), '--check'], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "method 'dflash', num_speculative_tokens 7" in r.stdout, r.stderr


def test_the_engine_profile_predicts_the_speedup_beside_the_measured_one(w, tmp_path):
    """`--profile`: the engine's costs at every drafted length (a paired check each), written as the profile training reads, and with
    `--val-extracted` the speed-up held-out acceptance predicts beside the one measured, at each length."""
    from dflash.extract import extract
    from dflash.speedup import read_profile
    (tmp_path / 'held.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:4]))                  # replies to read acceptance on
    x = extract(target=str(w / 'target'), data=str(tmp_path / 'held.jsonl'), out=str(tmp_path / 'x'), layer_ids=[1, 2], progress=False)
    save_drafter(DFlashDraftModel(drafter_config(T.AutoConfig.from_pretrained(w / 'target'), 1, 4, 16, [1, 2])), tmp_path / 'd4')
    r = engine('--drafter', tmp_path / 'd4', '--target', w / 'target', '--eval-data', w / 'asks.jsonl', '--num-prompts', 1, '--max-new-tokens', 8,
               '--reps', 1, '--threads', 1, '--no-ours', '--profile', '--profile-lengths', '3,1', '--val-extracted', x['out'], '--out', tmp_path / 'eng')
    assert r.returncode == 0, r.stderr[-3000:]
    prof = json.loads((tmp_path / 'eng' / 'engine.json').read_text())['profile']
    assert [row['n'] for row in prof['rows']] == [1, 3] and all(row['tokens_per_s']['plain'] > 0 for row in prof['rows'])
    assert len(prof['val_accept']) == 3 and 'the fastest:' in r.stdout and 'predicted' in r.stdout
    if prof['unstable']:              # a tiny target's millisecond forwards on a shared machine: contradicting parts, named, and no prediction
        assert "the profile's parts contradict each other" in r.stderr and all(row['predicted'] is None for row in prof['rows'])
        with pytest.raises(ValueError, match='its parts contradict each other'): read_profile(tmp_path / 'eng')
        return
    p = read_profile(tmp_path / 'eng')
    assert sorted(p['draft_ms']) == [1, 3] and sorted(p['verify_ms']) == [1, 2, 3, 4] and p['decode_ms'] > 0 and p['kind'] == 'dflash'
    assert all(row['predicted'] is not None for row in prof['rows'])
