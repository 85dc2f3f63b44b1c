"Extraction: taps equal HF's hidden states, the forward stops after the last tap, shards resume after SIGKILL, OOM splits, fp8, workers."
import json, os, signal, subprocess, sys, time
from pathlib import Path
import numpy as np, pytest, torch, transformers as T
from torch import nn
from transformers import AutoModelForCausalLM
from dflash.core import TRAIN_DATA, read_metrics
from dflash.tiny_target import target_config
from dflash.data import TokenizedDataset, prepare
from dflash.taps import default_layer_ids, decoder_layers, capture, tap_layers, pad_batch
from dflash.shards import quantize_fp8, dequantize_fp8, read_manifest, update_manifest
from dflash.extracted import ExtractedDataset, load_sample
from dflash.extract import extract, Extractor
from dflash.batching import find_token_budget

@pytest.fixture(scope='module')
def hybrid(make_target): return lambda layers=4, seed=0: make_target('qwen3_5', layers=layers, seed=seed)

@pytest.fixture(scope='module')
def work(tmp_path_factory, tok, make_target, save_target):
    "Saved tiny targets and a prepared dataset of conversations from 2 to ~700 tokens."
    d = tmp_path_factory.mktemp('extract')
    save_target(make_target('qwen3_5'), d / 'hybrid'); save_target(make_target('qwen3'), d / 'qwen3')
    rows = [json.loads(l) for l in open(TRAIN_DATA)][:40]
    long = [dict(id=f'long-{k}', conversations=sum((r['conversations'] for r in rows[k * 8:k * 8 + 8]), [])) for k in range(2)]
    short = [dict(id='short', conversations=[dict(**{'from': 'human'}, value='Hi'), dict(**{'from': 'gpt'}, value='Hi')])]
    (d / 'mixed.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows + long + short))
    prepare(d / 'mixed.jsonl', d / 'hybrid', d / 'dataset')
    return d

KW = dict(layer_ids=[0, 1, 2], token_budget=1024, shard_mb=0.05, progress=False)

def ref_states(model, ids, layer_ids):
    with torch.no_grad(): hs = model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[k + 1][0] for k in layer_ids], -1)

def all_rows(x):
    return {int(x.sample_ids[i]): x[i] for i in range(len(x))}

# --- layer ids and layer discovery

def test_default_layer_ids():
    assert default_layer_ids(64) == [1, 16, 31, 46, 61] and default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(8) == [1, 2, 3, 4, 5] and default_layer_ids(64, 1) == [32]

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
ARCHS = {
    'llama': lambda: T.LlamaConfig(**SMALL), 'qwen2': lambda: T.Qwen2Config(**SMALL), 'qwen3': lambda: T.Qwen3Config(**SMALL),
    'mistral': lambda: T.MistralConfig(**SMALL), 'gemma': lambda: T.GemmaConfig(**SMALL), 'gemma3_text': lambda: T.Gemma3TextConfig(**SMALL),
    'qwen3_next': lambda: T.Qwen3NextConfig(**SMALL, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                                            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=16, layer_types=['linear_attention', 'linear_attention', 'full_attention']),
}

@pytest.mark.parametrize('arch', list(ARCHS))
def test_decoder_layers_and_taps_on_architectures(arch):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
    layers = decoder_layers(m)
    assert layers is m.model.layers and len(layers) == 3
    x = torch.randint(0, 128, (1, 6))
    torch.testing.assert_close(capture(m, x, layer_ids=[1, 0]), torch.cat([ref_states(m, x[0], [1]), ref_states(m, x[0], [0])], -1)[None])

def test_decoder_layers_of_hybrid_and_multimodal_wrapper(tok, hybrid):
    h = hybrid()
    assert type(h).__name__ == 'Qwen3_5ForCausalLM' and decoder_layers(h) is h.model.layers
    vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    mm = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(text_config=target_config(tok, hidden=64, layers=4).to_dict(), vision_config=vc)).eval()
    assert decoder_layers(mm) is mm.model.language_model.layers
    x = torch.randint(0, 2000, (1, 7))
    torch.testing.assert_close(capture(mm, x, layer_ids=[2])[0], ref_states(mm, x[0], [2]))

def test_decoder_layers_error_names_the_class():
    class Plain(nn.Module):
        def __init__(self): super().__init__(); self.blocks = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match='of Plain'): decoder_layers(Plain())

# --- capture

@pytest.mark.parametrize('kind', ['qwen3_5', 'qwen3'])
def test_batched_capture_equals_single_sample_hidden_states(tok, make_target, kind):
    "Right-padded batches mixing lengths 1..300 give each sample's own output_hidden_states (incl. linear-attention layers)."
    m = make_target(kind)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (300, 1, 64, 65, 7, 129)]
    ids, mask, index = pad_batch(seqs, pad_id=tok.pad_token_id)
    rows = capture(m, ids, mask, [0, 2, 1], index)
    a = 0
    for s in seqs:
        torch.testing.assert_close(rows[a:a + len(s)], ref_states(m, s, [0, 2, 1]), atol=2e-5, rtol=1e-4); a += len(s)
    assert a == len(rows)
    twice = capture(m, ids, mask, [1, 1], index)   # the DFlash rule repeats layers of very shallow targets
    torch.testing.assert_close(twice, torch.cat([rows[:, 128:], rows[:, 128:]], -1))

def test_bf16_capture_within_bf16_tolerance(make_target):
    m = make_target('qwen3').to(torch.bfloat16)
    seqs = [list(range(5, 205)), [7, 8, 9]]
    ids, mask, index = pad_batch(seqs)
    rows = capture(m, ids, mask, [1, 2], index)
    torch.testing.assert_close(rows[200:], ref_states(m, seqs[1], [1, 2]), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(rows[:200], ref_states(m, seqs[0], [1, 2]), atol=2e-2, rtol=2e-2)

def test_forward_stops_after_last_tap(hybrid):
    m = hybrid(layers=6)
    calls = []
    hooks = [mod.register_forward_hook(lambda *a, n=n: calls.append(n)) for n, mod in
             [*((f'layer{i}', l) for i, l in enumerate(m.model.layers)), ('norm', m.model.norm), ('lm_head', m.lm_head)]]
    capture(m, torch.tensor([[5, 6, 7]]), layer_ids=[3, 1])
    assert calls == ['layer0', 'layer1', 'layer2', 'layer3']
    for h in hooks: h.remove()

def test_hooks_removed_after_error(tok, hybrid):
    m = hybrid()
    count = lambda: sum(len(x._forward_hooks) for x in m.modules())
    n0 = count()
    with pytest.raises(RuntimeError, match='boom'):
        with tap_layers(m, [0, 1]):
            assert count() == n0 + 2
            raise RuntimeError('boom')
    assert count() == n0
    with pytest.raises(IndexError): capture(m, torch.tensor([[len(tok) + 3]]), layer_ids=[1])
    assert count() == n0
    with torch.no_grad(): assert m(torch.tensor([[5, 6]])).logits.shape == (1, 2, len(tok))

# --- the job

@pytest.fixture(scope='module')
def base(work):
    "One uninterrupted run on the hybrid; the reference for resume, OOM and worker tests."
    r = extract(work / 'hybrid', work / 'dataset', work / 'base', **KW)
    return r, ExtractedDataset(work / 'base')

def test_extract_stores_what_each_sample_gives_alone(work, base):
    r, x = base
    ds = TokenizedDataset.load(work / 'dataset')
    m = AutoModelForCausalLM.from_pretrained(work / 'hybrid').eval()
    assert r['complete'] and len(x) == len(ds) == 43 and list(x.sample_ids) == list(range(43))
    assert ds.lengths.min() < 20 and ds.lengths.max() > 600, 'very different lengths'
    man = read_manifest(work / 'base')
    assert man['complete'] and man['layer_ids'] == [0, 1, 2] and man['hidden_size'] == 64 and man['dtype'] == 'float32'
    assert man['num_samples'] == 43 and man['num_tokens'] == int(ds.lengths.sum()) and len(man['shards']) > 3
    assert {'file', 'num_samples', 'num_tokens', 'sha256'} <= set(man['shards'][0]) and len(man['target_config_sha256']) == 64
    assert x.verify_all()
    for i in range(len(ds)):
        s = x[i]
        assert s['sample_id'] == i and s['hidden_states'].shape == (ds.lengths[i], 3 * 64)
        assert np.array_equal(s['input_ids'].numpy(), ds[i]['input_ids']) and np.array_equal(s['loss_mask'].numpy(), ds[i]['loss_mask'] > 0)
        torch.testing.assert_close(s['hidden_states'], ref_states(m, ds[i]['input_ids'], [0, 1, 2]), atol=2e-5, rtol=1e-4)
    s = load_sample(work / 'base', 42)
    assert s['sample_id'] == 42 and torch.equal(s['hidden_states'], x[42]['hidden_states'])
    recs = [r for r in read_metrics(work / 'base') if 'tokens_per_s' in r]
    assert recs and {'samples_per_s', 'tokens_per_s', 'padding_efficiency', 'batch_size_mean', 'eta_s', 'peak_mem_bytes', 'write_queue'} <= set(recs[-1])

def test_shard_layout(work, base):
    from safetensors import safe_open
    man = read_manifest(work / 'base')
    with safe_open(work / 'base' / man['shards'][0]['file'], 'pt') as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert set(t) == {'hidden_states', 'input_ids', 'loss_mask', 'cu_seqlens', 'sample_ids'}
    n, T_ = man['shards'][0]['num_samples'], man['shards'][0]['num_tokens']
    assert t['hidden_states'].shape == (T_, 192) and t['input_ids'].shape == t['loss_mask'].shape == (T_,)
    assert t['cu_seqlens'].shape == (n + 1,) and t['cu_seqlens'][-1] == T_ and t['sample_ids'].shape == (n,)

@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted_run(work):
    "The CLI killed with SIGKILL after its first shard, then started again, ends with what an uninterrupted run writes."
    kw = {**KW, 'token_budget': 256}   # many small batches, one shard each
    ref = ExtractedDataset(Path(extract(work / 'hybrid', work / 'dataset', work / 'uninterrupted', **kw)['out']))
    out = work / 'killed'
    cmd = [sys.executable, '-c', 'from dflash.extract import extract_cli; extract_cli()', '--target', str(work / 'hybrid'),
           '--data', str(work / 'dataset'), '--out', str(out), '--layer-ids', '0,1,2', '--token-budget', '256', '--shard-mb', '0.05', '--no-progress']
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.time()
    while not list(out.glob('shard-*.safetensors')) and p.poll() is None and time.time() - t0 < 60: time.sleep(0.002)
    p.send_signal(signal.SIGKILL); p.wait()
    assert p.returncode == -signal.SIGKILL, p.stdout.read().decode()[-2000:]
    m = read_manifest(out)
    assert not m['complete'] and m['num_samples'] < 43
    (out / 'shard-w0-99999.safetensors.tmp').write_bytes(b'half a shard')   # as if killed mid-write
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary['complete'] and summary['skipped'] == m['num_samples'] and summary['samples'] == 43 - m['num_samples']
    assert not list(out.glob('*.tmp'))
    x = ExtractedDataset(out)
    assert list(x.sample_ids) == list(range(43)), 'every sample exactly once'
    for i in range(43):
        a, b = x[i], ref[i]
        assert torch.equal(a['hidden_states'], b['hidden_states']) and torch.equal(a['input_ids'], b['input_ids']) and torch.equal(a['loss_mask'], b['loss_mask'])
    assert read_manifest(out)['complete'] and x.verify_all()

def test_refuses_other_target_layers_or_dtype(work, base):
    out = work / 'base'
    with pytest.raises(ValueError, match=r'layer_ids=\[0, 1, 2\] \(now \[0, 2\]\).*overwrite=True'):
        extract(work / 'hybrid', work / 'dataset', out, **{**KW, 'layer_ids': [0, 2]})
    with pytest.raises(ValueError, match='target_config_sha256'):
        extract(work / 'qwen3', work / 'dataset', out, **KW)
    with pytest.raises(ValueError, match="dtype='float32' \\(now 'bfloat16'\\)"):
        extract(work / 'hybrid', work / 'dataset', out, **{**KW, 'store_dtype': 'bf16'})
    again = extract(work / 'hybrid', work / 'dataset', out, **KW)   # same settings: nothing to do
    assert again['complete'] and again['samples'] == 0 and again['skipped'] == 43
    r = extract(work / 'qwen3', work / 'dataset', work / 'other', **{**KW, 'layer_ids': [1]})
    r = extract(work / 'hybrid', work / 'dataset', work / 'other', **KW, overwrite=True)
    assert r['complete'] and read_manifest(work / 'other')['layer_ids'] == [0, 1, 2]

def test_oom_splits_batches_and_loses_no_sample(work, base):
    L = TokenizedDataset.load(work / 'dataset').lengths
    r = extract(work / 'hybrid', work / 'dataset', work / 'oom', **KW, mem_limit_tokens=int(L.max()))
    assert r['complete'] and r['ooms'] and r['ooms'][0]['new_budget'] < 1024
    assert all(len(b) * L[b].max() <= L.max() for b in r['batches'])
    x = ExtractedDataset(work / 'oom')
    assert list(x.sample_ids) == list(range(43))
    for i in range(43): torch.testing.assert_close(x[i]['hidden_states'], base[1][i]['hidden_states'], atol=2e-5, rtol=1e-4)
    assert any(e.get('event') == 'oom' for e in read_metrics(work / 'oom'))

def test_oom_on_a_single_sample_names_it(work, hybrid):
    ds = TokenizedDataset.load(work / 'dataset')
    big = int(np.argmax(ds.lengths))
    ex = Extractor(hybrid(), ds, [0], token_budget=10_000, mem_limit_tokens=int(ds.lengths[big]) - 1)
    with pytest.raises(RuntimeError, match=f"sample {big} \\(id 'long-"): ex.run([[big]])

def test_find_token_budget():
    assert 4700 <= find_token_budget(lambda b: b <= 5000, 300, 1 << 20) <= 5000
    assert find_token_budget(lambda b: True, 300, 4000) == 4000 and find_token_budget(lambda b: False, 300, 4000) is None

def test_fp8_round_trip_and_disk(work, base):
    x = torch.randn(500, 192) * torch.logspace(-4, 4, 500)[:, None]
    q, s = quantize_fp8(x)
    y = dequantize_fp8(q, s)
    assert ((y - x).abs() <= x.abs() / 16 + s[:, None] / 512).all()
    r16 = extract(work / 'hybrid', work / 'dataset', work / 'bf16', **{**KW, 'store_dtype': 'bf16'})
    r8 = extract(work / 'hybrid', work / 'dataset', work / 'fp8', **{**KW, 'store_dtype': 'fp8'})
    x16, x8 = ExtractedDataset(work / 'bf16'), ExtractedDataset(work / 'fp8')
    assert x8.manifest['dtype'] == 'float8_e4m3fn' and x8.bytes_per_token() < 0.55 * x16.bytes_per_token()
    for i in (0, 40, 42):
        ref, got = base[1][i]['hidden_states'], x8[i]['hidden_states']
        sc = ref.abs().amax(-1, keepdim=True) / 448
        assert got.dtype == torch.float32 and ((got - ref).abs() <= ref.abs() / 16 + sc / 512 + 1e-6).all()

@pytest.mark.slow
def test_two_cpu_workers_give_the_same_set_as_one(work, base):
    r = extract(work / 'hybrid', work / 'dataset', work / 'w2', **KW, workers=2)
    x = ExtractedDataset(work / 'w2')
    assert r['complete'] and r['workers'] == 2
    assert {s['file'][:9] for s in x.manifest['shards']} == {'shard-w0-', 'shard-w1-'}
    assert list(x.sample_ids) == list(range(43))
    for i in range(43): torch.testing.assert_close(x[i]['hidden_states'], base[1][i]['hidden_states'], atol=2e-5, rtol=1e-4)

@pytest.mark.slow
def test_failed_worker_stops_the_job_naming_its_rank(work):
    with pytest.raises(RuntimeError, match=r"extract worker rank \d failed: RuntimeError: rank \d: sample \d+ .*does not fit in memory alone"):
        extract(work / 'hybrid', work / 'dataset', work / 'w2-fail', **KW, workers=2, mem_limit_tokens=5)
    assert not read_manifest(work / 'w2-fail')['complete']

def test_second_run_into_the_same_out_is_refused_while_one_runs(work):
    from dflash.extract import run_lock
    (work / 'busy').mkdir()
    with run_lock(work / 'busy'):
        with pytest.raises(RuntimeError, match='another extract is running'): extract(work / 'hybrid', work / 'dataset', work / 'busy', **KW)

def test_last_layer_is_stored_raw_not_normed(work, hybrid):
    "A tap on the last decoder layer stores its raw output (what serving hands a drafter), not HF's normed hidden_states[L]."
    extract(work / 'hybrid', work / 'dataset', work / 'last', **{**KW, 'layer_ids': [3]}, max_samples=3)
    m = AutoModelForCausalLM.from_pretrained(work / 'hybrid').eval()
    s = ExtractedDataset(work / 'last')[0]
    ids = s['input_ids'][None]
    torch.testing.assert_close(s['hidden_states'], capture(m, ids, layer_ids=[3])[0], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(s['hidden_states'], ref_states(m, ids[0], [3]), atol=1e-3)   # hidden_states[4] is after the final norm

def test_max_samples_extracts_a_prefix_that_is_complete(work):
    "max_samples extracts the first samples: a finished job (complete, the prefix recorded); an interrupted run is not complete."
    r = extract(work / 'hybrid', work / 'dataset', work / 'prefix', **KW, max_samples=10)
    m = read_manifest(work / 'prefix')
    assert r['complete'] and r['num_samples'] == 10 and m['complete'] and (m['requested_samples'], m['dataset_samples']) == (10, 43)
    assert len(ExtractedDataset(work / 'prefix', require_complete=True)) == 10
    update_manifest(work / 'prefix', lambda m: m.update(complete=False))    # what a run killed mid-way leaves (it starts so)
    with pytest.raises(ValueError, match='not complete'): ExtractedDataset(work / 'prefix', require_complete=True)
    r = extract(work / 'hybrid', work / 'dataset', work / 'prefix', **KW)     # the rest: resumed, now the whole dataset
    assert r['complete'] and r['skipped'] == 10 and r['num_samples'] == 43 and read_manifest(work / 'prefix')['requested_samples'] == 43

# --- the target's final state (distribution losses)

FINAL_ARCHS = {**ARCHS, 'gemma2-softcap': lambda: T.Gemma2Config(**SMALL, final_logit_softcapping=2.0),
               'cohere-logit-scale': lambda: T.CohereConfig(**SMALL, logit_scale=0.25),
               'granite-logits-scaling': lambda: T.GraniteConfig(**SMALL, logits_scaling=4.0)}

@pytest.mark.parametrize('arch', list(FINAL_ARCHS))
def test_final_state_gives_the_targets_logits(arch):
    "capture(final=True) on a padded batch: the taps unchanged, the head never run, and target_logits(final) = the forward's logits."
    from dflash.taps import final_norm, target_logits
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(FINAL_ARCHS[arch]()).eval()
    seqs = [list(range(3, 12)), [5, 6, 7], [9]]
    ids, mask, index = pad_batch(seqs)
    calls = []
    h = m.get_output_embeddings().register_forward_hook(lambda *a: calls.append('head'))
    rows, fin = capture(m, ids, mask, [1, 0], index, final=True)
    h.remove()
    assert calls == [] and final_norm(m) is m.model.norm and torch.equal(rows, capture(m, ids, mask, [1, 0], index))
    with torch.no_grad(): ref = m(input_ids=ids, attention_mask=mask).logits.flatten(0, 1)[index]
    torch.testing.assert_close(target_logits(m.get_output_embeddings(), fin, m.config), ref, atol=2e-5, rtol=1e-4)

def test_final_state_of_a_multimodal_wrapper_and_refusals(tok, make_target):
    from dflash.taps import final_norm
    vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    mm = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(text_config=target_config(tok, hidden=64, layers=4).to_dict(), vision_config=vc)).eval()
    x = torch.randint(0, 2000, (1, 7))
    _, fin = capture(mm, x, layer_ids=[1], final=True)
    with torch.no_grad(): torch.testing.assert_close(mm.lm_head(fin), mm(x).logits)
    assert final_norm(mm) is mm.model.language_model.norm
    with pytest.raises(TypeError, match='has no output head'): capture(T.AutoModel.from_config(make_target('qwen3').config), x, layer_ids=[1], final=True)

@pytest.fixture(scope='module')
def final_base(work):
    "An extraction with the final states (fp8, so both tensors have scales), small shards."
    kw = {**KW, 'final_hidden': True, 'store_dtype': 'fp8'}
    extract(work / 'hybrid', work / 'dataset', work / 'final', **kw)
    return kw, ExtractedDataset(work / 'final', verify=True)

def test_extract_final_states_are_the_targets_and_fp8_has_its_own_scales(work, base, final_base):
    from safetensors import safe_open
    from dflash.taps import target_logits
    kw, x = final_base
    man = read_manifest(work / 'final')
    assert man['final_hidden'] and man['complete'] and x.final_hidden and x.verify_all() and list(x.sample_ids) == list(range(43))
    with safe_open(work / 'final' / man['shards'][0]['file'], 'pt') as f:
        T_ = man['shards'][0]['num_tokens']
        assert f.get_slice('final_hidden').get_shape() == [T_, 64] and f.get_slice('final_scale').get_shape() == [T_]
    m = AutoModelForCausalLM.from_pretrained(work / 'hybrid').eval()
    for i in (0, 40, 42):
        s = x[i]
        with torch.no_grad(): ref = m(s['input_ids'][None]).logits[0]
        got = target_logits(m.lm_head, s['final_hidden'], m.config)
        assert s['final_hidden'].dtype == torch.float32 and (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95   # through fp8
        assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert 'final_hidden' not in base[1][0] and read_manifest(work / 'base')['final_hidden'] is False   # not asked: not stored

def test_extract_final_states_resume_and_corruption(work, final_base):
    "Damaged final rows are caught by verify (naming the shard) and redone on resume, bit for bit; a changed setting is refused."
    import shutil
    from dflash.extracted import CorruptShard
    kw, ref = final_base
    out = work / 'final-damaged'
    shutil.copytree(work / 'final', out)
    update_manifest(out, lambda m: m['shards'].pop())          # killed before its last shard was listed
    man = read_manifest(out); f = out / man['shards'][1]['file']
    n = int.from_bytes(f.read_bytes()[:8], 'little'); where = json.loads(f.read_bytes()[8:8 + n])['final_hidden']['data_offsets']
    with open(f, 'r+b') as fh: fh.seek(8 + n + where[0] + 3); fh.write(b'\x7f' * 16)    # inside final_hidden only
    with pytest.raises(CorruptShard, match=f"{man['shards'][1]['file']}: corrupt"):
        x = ExtractedDataset(out, verify=True); [x[i] for i in range(len(x))]
    for other in ({**kw, 'final_hidden': False}, {k: v for k, v in kw.items() if k != 'final_hidden'}):
        with pytest.raises(ValueError, match=r'final_hidden=True \(now False\)'): extract(work / 'hybrid', work / 'dataset', out, **other)
    r = extract(work / 'hybrid', work / 'dataset', out, **kw)
    x = ExtractedDataset(out, verify=True)
    assert r['complete'] and r['skipped'] > 0 and x.verify_all() and list(x.sample_ids) == list(range(43))
    for i in range(43): assert torch.equal(x[i]['final_hidden'], ref[i]['final_hidden']) and torch.equal(x[i]['hidden_states'], ref[i]['hidden_states'])

def test_an_extraction_from_before_final_states_still_loads_and_resumes(work, base):
    "A manifest without the key (older extractions): read as final_hidden=False, resumed with the default, refused with final_hidden=True."
    import shutil
    out = work / 'old'
    shutil.copytree(work / 'base', out)
    update_manifest(out, lambda m: m.pop('final_hidden'))
    x = ExtractedDataset(out)
    assert not x.final_hidden and set(x[0]) == {'hidden_states', 'input_ids', 'loss_mask', 'sample_id'}
    assert extract(work / 'hybrid', work / 'dataset', out, **KW)['skipped'] == 43
    with pytest.raises(ValueError, match=r'final_hidden=False \(now True\)'): extract(work / 'hybrid', work / 'dataset', out, **KW, final_hidden=True)
