"Training: the online pipeline learns, offline matches online, SIGKILL resume is exact, dead ranks end the job, torchrun across 'machines'."
import json, os, signal, subprocess, sys, time
from pathlib import Path
import pytest, torch
from dflash.core import TINY_TARGET, TRAIN_DATA, read_metrics, read_jsonl
from dflash.data import prepare
from dflash.batching import Plan
from dflash.extract import extract
from dflash.metrics import diagnose, plot_dashboard
from dflash.train import train
from dflash.checkpoint import latest_checkpoint
from dflash.recipe import TrainConfig

CLI = [sys.executable, '-c', 'from dflash.train import train_cli; train_cli()']

@pytest.fixture(scope='module')
def work(tmp_path_factory, make_target, save_target):
    "A random-weight 4-layer hybrid target, prepared datasets of 200 conversations and of their first 120."
    d = tmp_path_factory.mktemp('train')
    save_target(make_target('qwen3_5'), d / 'target')
    rows = open(TRAIN_DATA).read().splitlines()[:200]
    (d / 'train.jsonl').write_text('\n'.join(rows) + '\n')
    (d / 'train120.jsonl').write_text('\n'.join(rows[:120]) + '\n')
    prepare(d / 'train.jsonl', d / 'target', d / 'dataset')
    prepare(d / 'train120.jsonl', d / 'target', d / 'dataset120')
    return d

def kw(work, **over):
    "A small job on the random target, every setting the recipe would choose given explicitly."
    base = dict(target=str(work / 'target'), data=str(work / 'dataset'), max_samples=120, token_budget=512, num_anchors=16, num_layers=1,
                lr=1e-2, warmup=0, min_lr_ratio=0.1, weight_decay=0.01, epochs=2.0, max_length=2048, log_every=1, ckpt_every=0,
                final_eval=False, progress=False, dead_after_s=10)
    return {**base, **over}

def losses(out): return {m['step']: m['loss'] for m in read_metrics(out) if 'loss' in m}

def test_plan_is_independent_of_targets():
    "A drafter's micro-batch stream depends on the data, budget, drafters and seed only; drafters get equal counts."
    L = torch.randint(10, 300, (500,)).numpy()
    p = Plan(L, 2048, 64, drafters=3, seed=1, epochs=2)
    assert len({len(b) for b in p.epoch(0)}) == 1 and p.total_steps == 2 * p.per_epoch
    assert [p.batch(2, k) for k in range(p.total_micro)][:p.per_epoch] == p.epoch(0)[2]

@pytest.mark.slow
def test_online_2x1_learns(work, tmp_path):
    "2 target ranks + 1 drafter rank on gloo (the embedded trained target): the loss falls; metrics, checkpoints and the final drafter are written."
    out = tmp_path / 'run'
    r = train(**kw(work, out=str(out), target=str(TINY_TARGET), targets=2, drafters=1, max_steps=16, ckpt_every=5, keep=2,
                   q_depth=3, q_gb=0.0015, lr=3e-3))          # 1.5 MiB: three of its largest batches (512 tokens of one 256-wide tap, fp32)
    ls = losses(out)
    assert sorted(ls) == list(range(1, 17)) and r['step'] == 16
    first, last = sum(ls[k] for k in (1, 2, 3)) / 3, sum(ls[k] for k in (14, 15, 16)) / 3
    assert last < first - 1.0, (first, last)
    m = [m for m in read_metrics(out) if 'loss' in m][-1]
    for k in ('step', 'loss', 'acc', 'lr', 'tokens_per_s', 'q_hs', 'target_batches_per_s', 'drafter_batches_per_s', 'eta_s', 'peak_mem_bytes'):
        assert k in m, k
    assert len(m['acc']) == 15 and max(x['q_hs'] for x in read_metrics(out) if 'q_hs' in x) <= 2 * 3   # 2 targets x q_depth 3
    assert 0 < max(x['q_peak_bytes'] for x in read_metrics(out) if 'q_hs' in x) <= m['q_bytes_capacity'] == int(0.0015 * 2**30)
    ck = sorted(p.name for p in (out / 'checkpoints').iterdir())
    assert ck == ['best', 'step-15', 'step-16'] and latest_checkpoint(out).name == 'step-16'   # every 5 and at the end; keep=2; the best by held-out acceptance
    cfg = json.loads((out / 'drafter/config.json').read_text())
    assert cfg['architectures'] == ['DFlashDraftModel'] and cfg['dflash_config']['target_layer_ids'] == [4]
    assert (out / 'checkpoints/step-16/trainer.pt').exists() and (out / 'checkpoints/step-16/model.safetensors').exists()
    assert diagnose(out).split(';')[0].endswith('Ktok/s')
    plot_dashboard(out)
    assert all((out / f'{n}.png').exists() for n in ('loss', 'accuracy', 'throughput', 'queue', 'dashboard'))

@pytest.fixture(scope='module')
def extracted(work, tmp_path_factory):
    x = tmp_path_factory.mktemp('x')
    extract(target=work / 'target', data=work / 'dataset120', out=x, layer_ids=[2], token_budget=512, progress=False)
    return x

def test_offline_matches_online(work, extracted, tmp_path):
    "The same batches and seed: the first step's loss offline (from an extraction) equals the online pipeline's."
    train(**kw(work, out=str(tmp_path / 'on'), targets=1, drafters=1, max_steps=2))
    train(**kw(work, out=str(tmp_path / 'off'), extracted=str(extracted), drafters=1, max_steps=2))
    on, off = losses(tmp_path / 'on'), losses(tmp_path / 'off')
    assert abs(on[1] - off[1]) < 1e-4 and abs(on[2] - off[2]) < 1e-3, (on, off)

def test_dspark_paper_loss_offline_matches_online(work, tmp_path):
    """DSpark with the paper's loss (0.1 CE + 0.9 L1 against the target's distribution, and the confidence term): from an extraction
    that stores the target's final states, and online, where the target rank sends them, the same first steps."""
    x = tmp_path / 'xf'
    extract(target=work / 'target', data=work / 'dataset120', out=x, layer_ids=[2], token_budget=512, progress=False, final_hidden=True)
    run = dict(arch='dspark', drafters=1, max_steps=2, servable=False)
    train(**kw(work, out=str(tmp_path / 'on'), targets=1, **run))
    train(**kw(work, out=str(tmp_path / 'off'), extracted=str(x), **run))
    on, off = losses(tmp_path / 'on'), losses(tmp_path / 'off')
    assert abs(on[1] - off[1]) < 1e-4 and abs(on[2] - off[2]) < 1e-3, (on, off)
    c = json.loads((tmp_path / 'off/config.json').read_text())
    assert c['config']['loss_terms'] == 'ce:0.1,l1:0.9' and c['config']['block_size'] == 7 and c['config']['loss'] == 'decay'
    assert all(len(m['acc']) == 7 for m in read_metrics(tmp_path / 'off') if 'loss' in m)

def cli_args(**a):
    "Command-line options of keyword arguments (booleans as --flag / --no-flag)."
    return [(f'--{k}' if v else f'--no-{k}') if isinstance(v, bool) else f'--{k}={v}' for k, v in a.items()]

def test_sigkill_resume_is_exact(work, extracted, tmp_path):
    "A run killed with SIGKILL resumes from its last complete checkpoint; its next losses equal an uninterrupted run's."
    args = kw(work, extracted=str(extracted), drafters=1, max_steps=40, ckpt_every=3, keep=1, threads=1, epochs=1)
    ref = tmp_path / 'ref'
    train(out=str(ref), **args)
    out = tmp_path / 'killed'
    a = {k: v for k, v in args.items() if k not in ('progress',)}
    p = subprocess.Popen(CLI + cli_args(out=out, **a), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while latest_checkpoint(out) is None and p.poll() is None and time.time() - t0 < 120: time.sleep(0.05)
    p.send_signal(signal.SIGKILL); p.wait()
    ck = latest_checkpoint(out)
    assert ck is not None and int(ck.name.split('-')[1]) < 39
    k = int(ck.name.split('-')[1])
    killed = [m['step'] for m in read_metrics(out) if 'loss' in m]
    train(out=str(out), resume=True, **args)
    after = [m for m in read_metrics(out) if 'loss' in m and m['step'] > k]
    assert [m['step'] for m in after] == list(range(k + 1, 41))   # the killed run's steps past k went aside, not kept twice
    past = [s for s in killed if s > k]
    if past: assert [m['step'] for m in read_jsonl(out / f'metrics.after-{k}.jsonl') if 'loss' in m] == past
    want = losses(ref)
    for m in after: assert abs(m['loss'] - want[m['step']]) < 1e-5, (m['step'], m['loss'], want[m['step']])

def start_long_job(work, out, targets):
    "Start a job that would run for ages (1 drafter) in a subprocess printing its result as JSON; return once it logs."
    code = f"from dflash.train import train; import json; print(json.dumps(train(**{kw(work, out=str(out), targets=targets, drafters=1, max_steps=100000, epochs=100)!r})))"
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while len(read_metrics(out)) < 2 and p.poll() is None and time.time() - t0 < 180: time.sleep(0.2)
    return p

@pytest.mark.slow
def test_dead_rank_ends_job(work, tmp_path):
    "SIGKILL one target rank mid-run: every other rank exits non-zero on its own within 60 s, and the error names the rank."
    out = tmp_path / 'run'
    p = start_long_job(work, out, targets=2)
    assert p.poll() is None, p.stdout.read()
    os.kill(int((out / 'logs/rank-1.pid').read_text()), signal.SIGKILL); t_kill = time.time()
    text, _ = p.communicate(timeout=90)
    assert p.returncode != 0 and time.time() - t_kill < 60
    assert 'rank 1 (target 1) failed: killed by signal SIGKILL' in text, text[-3000:]
    assert latest_checkpoint(out) is not None, 'the drafter saved what it had learnt before the job ended'   # nothing lost

@pytest.mark.slow
def test_sigterm_saves(work, tmp_path):
    "SIGTERM on the drafter rank: it saves a checkpoint at the step it reached, and the job ends cleanly."
    out = tmp_path / 'run'
    p = start_long_job(work, out, targets=1)
    os.kill(int((out / 'logs/rank-1.pid').read_text()), signal.SIGTERM)
    text, _ = p.communicate(timeout=90)
    assert p.returncode == 0, text[-3000:]
    res = json.loads(text.strip().splitlines()[-1])
    assert res['stopped'] == 'signal' and latest_checkpoint(out).name == f"step-{res['step']}"

@pytest.mark.slow
def test_torchrun_two_nodes(work, tmp_path):
    "Two torchrun 'machines' on localhost (one rendezvous): a target on one, a drafter on the other, training together."
    import socket
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    out = tmp_path / 'run'
    a = cli_args(**kw(work, out=out, targets=1, drafters=1, max_steps=4))
    procs = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--node-rank', str(n), '--nproc-per-node', '1',
                               '--rdzv-backend', 'c10d', '--rdzv-endpoint', f'127.0.0.1:{port}', '--rdzv-id', 'dflash-test',
                               '--no-python', *CLI, *a],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    texts = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), '\n'.join(t[-2000:] for t in texts)
    assert sorted(losses(out)) == [1, 2, 3, 4] and (out / 'drafter/model.safetensors').exists()

@pytest.mark.slow
def test_ddp_2x2_grad_accum(work, tmp_path):
    "2 target ranks + 2 drafter ranks (DDP, gradient accumulation 2): both drafters take the same steps and the loss falls."
    out = tmp_path / 'run'
    r = train(**kw(work, out=str(out), targets=2, drafters=2, grad_accum=2, max_steps=6, ckpt_every=3))
    ls = losses(out)
    assert r['step'] == 6 and sorted(ls) == list(range(1, 7)) and ls[6] < ls[1]
    assert json.loads((out / 'checkpoints/step-6/COMPLETE').read_text())['step'] == 6

def test_collectives_run_on_the_group_device(monkeypatch):
    "drafters > 1 on CUDA: NCCL takes tensors on the group's device only, so every all-reduce gets its tensor moved there."
    from types import SimpleNamespace
    from dflash.trainer import Trainer
    seen = []
    monkeypatch.setattr(torch.distributed, 'all_reduce', lambda t, group=None: seen.append(t.device))
    drafter = SimpleNamespace(group=object(), cfg=SimpleNamespace(drafters=2), device=torch.device('meta'))   # a device that is not the CPU
    assert Trainer.all_sum(drafter, torch.ones(3)).device.type == 'meta' and seen == [torch.device('meta')]


def published_layout(path, target_config, layer_types, window, layer_ids, mask_token_id, block_size=8, seed=0):
    """A drafter for `target_config` written as the published Qwen3.6-27B drafter is: a hand-written config.json (auto_map,
    `sliding_window` on top and nothing of ours) and bf16 safetensors of the named tensors, random."""
    H, heads, kvh, d, I, n = target_config.hidden_size, 4, 2, target_config.hidden_size // 4, 2 * target_config.hidden_size, len(layer_types)
    cfg = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "model_type": "qwen3",
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kvh,
           "head_dim": d, "vocab_size": target_config.vocab_size, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
           "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16", "tie_word_embeddings": False, "rope_theta": 10000000,
           "layer_types": layer_types, "sliding_window": window, "max_window_layers": n, "use_sliding_window": False,
           "block_size": block_size, "num_target_layers": target_config.num_hidden_layers,
           "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids}}
    shapes = {'fc.weight': (H, len(layer_ids) * H), 'hidden_norm.weight': (H,), 'norm.weight': (H,)}
    for i in range(n):
        p = f'layers.{i}.'
        shapes.update({p + 'self_attn.q_proj.weight': (heads * d, H), p + 'self_attn.k_proj.weight': (kvh * d, H),
                       p + 'self_attn.v_proj.weight': (kvh * d, H), p + 'self_attn.o_proj.weight': (H, heads * d),
                       p + 'self_attn.q_norm.weight': (d,), p + 'self_attn.k_norm.weight': (d,), p + 'mlp.gate_proj.weight': (I, H),
                       p + 'mlp.up_proj.weight': (I, H), p + 'mlp.down_proj.weight': (H, I), p + 'input_layernorm.weight': (H,),
                       p + 'post_attention_layernorm.weight': (H,)})
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (0.05 * torch.randn(s, generator=g) + (1 if k.endswith('norm.weight') else 0)).to(torch.bfloat16) for k, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / 'config.json').write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    save_file(tensors, path / 'model.safetensors', metadata={'format': 'pt'})
    return tensors

def test_init_from_a_published_checkpoint_fine_tunes_it(work, tmp_path):
    """`init_from` a drafter in the published layout (2 sliding + 1 full, window 32): the run takes its layers, taps, block,
    mask token and window, starts from its weights (a step at lr 1e-12 changes none), and its model card says where it started."""
    from transformers import AutoConfig
    from safetensors.torch import load_file
    tc = AutoConfig.from_pretrained(work / 'target')
    types = ['sliding_attention', 'sliding_attention', 'full_attention']
    src = published_layout(tmp_path / 'published', tc, types, 32, [0, 1, 2], 3)
    out = tmp_path / 'run'
    r = train(**kw(work, out=str(out), targets=1, max_steps=1, ckpt_every=1, lr=1e-12, num_layers=None, init_from=str(tmp_path / 'published')))
    run = json.loads((out / 'config.json').read_text())
    c, o = run['config'], run['origins']
    assert (c['num_layers'], c['layer_ids'], c['block_size'], c['mask_token_id'], c['sliding_window']) == (3, [0, 1, 2], 8, 3, 32)
    assert c['layer_types'] == ','.join(types) and o['layer_types'].startswith('init_from')
    got = load_file(out / 'checkpoints/step-1/model.safetensors')
    assert set(got) == set(src) and all(torch.allclose(got[k], src[k].float(), atol=1e-6) for k in src)
    d = json.loads((out / 'drafter/config.json').read_text())
    assert d['layer_types'] == types and d['sliding_window'] == 32 and d['dflash_config']['swa_window_size'] == 32 and d['target_model']
    card = (out / 'drafter/README.md').read_text()
    assert 'Fine-tuned from the drafter' in card and '2 sliding-window layers (window 32: at most 31 context positions' in card
    assert 'auto_map' not in d and r['step'] == 1                      # the published remote code is not beside ours

@pytest.mark.parametrize('case', ['another target', 'block size', 'taps', 'layer types', 'weights', 'extraction'])
def test_init_from_refuses_a_drafter_that_does_not_fit(work, extracted, tmp_path, case, make_target, save_target):
    "Each misfit is refused before any rank starts or anything is written, naming both sides."
    from transformers import AutoConfig
    tc = AutoConfig.from_pretrained(work / 'target')
    ck = tmp_path / 'ck'
    published_layout(ck, tc, ['sliding_attention', 'full_attention'], 32, [0, 2], 3)
    over, want = dict(init_from=str(ck), num_layers=None), None
    if case == 'another target':
        other = save_target(make_target('qwen3_5', hidden=128), tmp_path / 'wide')
        over['target'], want = str(other), f'has hidden_size 64; the target {other} has 128'
    if case == 'block size': over['block_size'], want = 16, 'has block_size=8; this run has block_size=16'
    if case == 'taps': over['layer_ids'], want = [1, 3], 'has layer_ids=[0, 2]; this run has layer_ids=[1, 3]'
    if case == 'layer types': over['layer_types'], want = 'full,full', "this run has layer_types='full_attention,full_attention'"
    if case == 'weights':
        from safetensors.torch import load_file, save_file
        sd = load_file(ck / 'model.safetensors'); del sd['layers.1.mlp.up_proj.weight']; save_file(sd, ck / 'model.safetensors')
        want = "layers.1.mlp.up_proj.weight: missing in the file"
    if case == 'extraction': over['extracted'], want = str(extracted), f'taps layers [0, 2]; the extraction {extracted} holds layers [2]'
    with pytest.raises(ValueError, match=want.replace('[', r'\[').replace(']', r'\]').replace('(', r'\(').replace(')', r'\)')):
        train(**kw(work, out=str(tmp_path / 'run'), targets=1, max_steps=1, **over))
    assert not (tmp_path / 'run' / 'config.json').exists() and not (tmp_path / 'run' / 'metrics.jsonl').exists()


@pytest.mark.slow
def test_resume_of_a_run_from_before_layer_types_keeps_full_attention(work, tmp_path):
    """A checkpoint whose run recorded no layer_types (written before they existed: all full) resumes with full attention,
    not the hybrid target's sliding default; a run given the layer types in another spelling resumes too."""
    out = tmp_path / 'run'
    train(**kw(work, out=str(out), targets=1, max_steps=2, ckpt_every=1, num_layers=2, layer_types='full,full'))
    ck = latest_checkpoint(out)
    st = torch.load(ck / 'trainer.pt', weights_only=False)
    for k in ('layer_types', 'sliding_window', 'init_from'): st['config'].pop(k)
    torch.save(st, ck / 'trainer.pt')
    done = json.loads((ck / 'COMPLETE').read_text())
    for k in ('layer_types', 'sliding_window', 'init_from'): done['config'].pop(k)
    (ck / 'COMPLETE').write_text(json.dumps(done))
    train(**kw(work, out=str(out), targets=1, max_steps=3, ckpt_every=1, num_layers=2, resume=True, resume_changes='max_steps'))
    run = json.loads((out / 'config.json').read_text())
    assert run['config']['layer_types'] == 'full_attention,full_attention' and run['origins']['layer_types'] == "the checkpoint's"
    train(**kw(work, out=str(out), targets=1, max_steps=4, ckpt_every=1, num_layers=2, resume=True, resume_changes='max_steps',
               layer_types='full_attention, full_attention'))
    assert sorted(losses(out)) == [1, 2, 3, 4]
