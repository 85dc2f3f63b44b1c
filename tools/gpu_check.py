"""The one GPU script: every GPU path of a run, each asserting its result, each under its own timeout, with a table for BENCHMARKS.md.

    .venv/bin/python tools/gpu_check.py [--out runs/gpu-check]        on a machine with a GPU (`make gpu-check`)
    .venv/bin/python tools/gpu_check.py --part 1 (then --part 2)        each within a device call of 10 minutes (`make gpu-check PART=1`)
    .venv/bin/python tools/gpu_check.py --cpu                           the same paths in a reduced form, on a CPU (`make test`)

Checks (a wrong result fails the check; the script exits 1 if any failed):
1. flex:     the drafter's block-masked attention (a sliding layer and a full one) through flex_attention, compiled on a GPU, against
             SDPA: the same loss and gradients; then a sweep of batch shapes, both modes and autocast on and off stays within the
             compiled function's recompile limit.
2. step:     a bf16 training step at Qwen3-8B's drafter shapes (hidden 4096, 151936 tokens, 5 layers), eager and compiled: finite loss
             and gradients, tokens/s and MFU, compiled / eager; then Muon on the device: a finite step that moves the weights.
3. extract:  extraction of a random-weight ~1.5B qwen3_5 hybrid in bf16: the stored hidden states equal a direct capture of the same
             samples; ours against the bare forward to the last tap and the naive recipe; `gpus=N` worker processes with 2+ GPUs.
4. budget:   the 'auto' token-budget probe, then an out-of-memory forced by filling the GPU, which the split-and-retry survives.
5. train:    offline training from the extraction with the held-out reading (finite loss, a held-out tau); a resume from its
             middle checkpoint: the first step after it bit-exact where the kernels are deterministic (the CPU; a GPU with
             torch.use_deterministic_algorithms), else within 1e-3 as the rest and the final drafter's weights are.
6. online:   1 target + 1 drafter sharing the GPU (gloo through the host): the loss falls and the HS queue stays inside its byte
             bound; with 2+ GPUs, 2 + 2 ranks on NCCL with DDP.
7. stop:     SIGTERM to the drafter rank of a running online job: every rank ends within seconds, with a checkpoint.
8. lossless: the lossless loop with the embedded target in bf16 (near-ties allowed, `dflash.evaluate.near_ties`), and DDTree
             verification of 16 and 64 nodes on fp32 targets (a Qwen3 and the hybrid): outputs equal the target's own.
9. seeds:    the seeds' job at reduced depth: the 27B hybrid config's widths (hidden 5120, its 248K-token head) with 4 layers of
             random weights and a drafter of 2 layers, one target and one drafter rank sharing the GPU with the run's memory plan (its token budget, grad_ckpt),
             trained online until a SIGTERM stops it with a checkpoint; each rank's measured peak against the plan's.
Each check's timeout does not count the time this process spends compiling (dynamo's callbacks; compiles in the ranks a check starts
do count), which is printed apart; a check
that ends, passes, fails or times out leaves no process of its own behind. The estimate is printed first, the total last.
Writes OUT/gpu-check.json and OUT/gpu-check.md (the table).
"""
import argparse, contextlib, json, os, platform, shutil, signal, subprocess, sys, tempfile, threading, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12}   # dense bf16 TFLOP/s, the spec sheets'
# Seconds each check is expected to take on one H100 or H200 (compiles of flex and of the step included), and its timeout.
ESTIMATE = dict(flex=60, step=120, extract=70, budget=40, train=50, online=45, stop=40, lossless=40, seeds=150)
TIMEOUT = {k: 2 * v for k, v in ESTIMATE.items()}
# Two parts, each within one device call of 10 minutes with room (`make gpu-check PART=1`, then `PART=2`); extract runs first in
# both, as the checks after it read its target and data.
PARTS = {1: ['flex', 'step', 'extract', 'budget', 'train', 'lossless'], 2: ['extract', 'online', 'stop', 'seeds']}
LIMIT = 540                                                    # seconds: a device call's 600, less the machine's start


def peak(torch):
    if not torch.cuda.is_available(): return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(torch):
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return time.perf_counter()


def finite(torch, model, loss):
    "The loss and every gradient of `model` are finite."
    return bool(torch.isfinite(loss).all()) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def hybrid_config(tok, cpu):
    "A qwen3_5 hybrid text config: ~1.5B parameters on a GPU, toy-sized on a CPU."
    from dflash.tiny_target import target_config
    if cpu: return target_config(tok, hidden=64, layers=4)
    c = target_config(tok, hidden=2048, layers=24)
    c.vocab_size = 151936
    return c


def check_flex(a, torch, dev):
    from transformers import Qwen3Config
    from torch._dynamo.utils import counters
    import dflash.blocks as blocks
    from dflash.model import DFlashDraftModel, drafter_config
    H = 64 if a.cpu else 1024
    tc = Qwen3Config(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=H // 8, vocab_size=2048)
    torch.manual_seed(0)
    b, S = 2, 128 if a.cpu else 1024                         # a sliding layer (window S/4) and a full one: both masks on flex
    d = DFlashDraftModel(drafter_config(tc, 2, 16, 5, [1, 4], layer_types=['sliding_attention', 'full_attention'], sliding_window=S // 4)).to(dev)
    emb, head = torch.nn.Embedding(2048, H).to(dev).requires_grad_(False), torch.nn.Linear(H, 2048, bias=False).to(dev).requires_grad_(False)
    d.attach_target(embed_tokens=emb, lm_head=head)
    g = torch.Generator(device='cpu').manual_seed(1)
    hs, ids = torch.randn(b, S, 2 * H, generator=g).to(dev), torch.randint(0, 2048, (b, S), generator=g).to(dev)
    lm = torch.ones(b, S, dtype=torch.long, device=dev); lm[:, :S // 4] = 0
    anchors = torch.sort(torch.randint(S // 4, S - 2, (b, 8), generator=g), dim=1).values.to(dev)
    out, grads = {}, dev.type == 'cuda'                     # flex_attention has no backward on a CPU: forward only there
    for impl in ('sdpa', 'flex'):
        d.zero_grad()
        with torch.set_grad_enabled(grads): o = d(hs, ids, lm, anchors=anchors, attn_impl=impl)
        if grads: o.loss.backward()
        out[impl] = (o.loss.item(), {n: p.grad.clone() for n, p in d.named_parameters()} if grads else {})
    (ls, gs), (lf, gf) = out['sdpa'], out['flex']
    worst = max(((gs[n] - gf[n]).abs().max() / gs[n].abs().max().clamp_min(1e-12)).item() for n in gs) if grads else None
    assert abs(ls - lf) < 1e-4 * max(1, abs(ls)) and (worst is None or worst < 1e-3), (ls, lf, worst)
    # the shapes, modes and autocast of a run: the compiled flex stays within its limit ('eager' backend on a CPU: the same guards)
    import torch._dynamo
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if a.cpu: blocks.FLEX_BACKEND = 'eager'
    n0 = counters['stats']['unique_graphs']
    for bb, SS, A in [(1, S // 2, 1), (2, S, 9), (3, S + 40, 12), (4, S // 2 + 7, 5)]:
        x, y = torch.randn(bb, SS, 2 * H, device=dev), torch.randint(0, 2048, (bb, SS), device=dev)
        for grad, amp in ((True, True), (False, False), (False, True)):
            with torch.set_grad_enabled(grad and grads), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                o = d(x, y, torch.ones_like(y), num_anchors=A, attn_impl='flex')
            if grad and grads: o.loss.backward()
    graphs = counters['stats']['unique_graphs'] - n0
    assert graphs <= blocks.FLEX_RECOMPILE_LIMIT, graphs
    return dict(loss_sdpa=ls, loss_flex=lf, max_relative_grad_difference=worst, compiled_graphs=graphs)


def check_step(a, torch, dev):
    "A training step at Qwen3-8B's drafter shapes in bf16 (GPU), or a tiny one (CPU): finite, tokens/s, MFU, compiled; then Muon."
    from types import SimpleNamespace
    from transformers import Qwen3Config
    from dflash.model import DFlashDraftModel, drafter_config
    from dflash.plan import drafter_flops_per_token
    from dflash.optim import make_optimizer
    if a.cpu: tc, S, b = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=2048), 256, 2
    else: tc, S, b = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936), 3072, 4
    dc = drafter_config(tc, 5, 16, 151669 if not a.cpu else 5, None)
    torch.manual_seed(0)
    d = DFlashDraftModel(dc).to(dev)
    H, V = tc.hidden_size, tc.vocab_size
    dt = torch.bfloat16 if dev.type == 'cuda' else torch.float32
    emb, head = torch.nn.Embedding(V, H).to(dev, dt).requires_grad_(False), torch.nn.Linear(H, V, bias=False).to(dev, dt).requires_grad_(False)
    d.attach_target(embed_tokens=emb, lm_head=head)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
    hs = torch.randn(b, S, len(dc.target_layer_ids) * H, device=dev, dtype=dt)
    ids, lm = torch.randint(0, V, (b, S), device=dev), torch.ones(b, S, dtype=torch.long, device=dev)
    auto = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == 'cuda')
    A = 32 if a.cpu else 512
    def step(o=opt):
        with auto: out = d(hs, ids, lm, num_anchors=A)
        out.loss.backward()
        ok = finite(torch, d, out.loss)
        o.step(); o.zero_grad(set_to_none=True)
        assert ok, 'the loss or a gradient is not finite'
    def rate(n):
        for _ in range(2): step()
        t0 = sync(torch)
        for _ in range(n): step()
        return n * b * S / (sync(torch) - t0)
    tps = rate(3 if a.cpu else 10)
    flops = drafter_flops_per_token(dc, S, A) * tps
    pk = peak(torch)
    r = dict(tokens_per_s=tps, tflops=flops / 1e12, mfu=flops / pk if pk else None,
             peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if dev.type == 'cuda' else None)
    if not a.cpu:    # TrainConfig.compile's default: on only if this says it pays
        d.compile(dynamic=True); r['compiled_tokens_per_s'] = rate(10); r['compiled / eager'] = r['compiled_tokens_per_s'] / tps
    cfg = SimpleNamespace(optimizer='muon', lr=1e-3, weight_decay=0.0, muon_ns_steps=5)
    mo, _ = make_optimizer(d, cfg, lambda s: 1.0)
    before = d.fc.weight.detach().clone(); step(mo)
    assert not torch.equal(before, d.fc.weight) and torch.isfinite(d.fc.weight).all(), 'Muon did not move fc, or broke it'
    r['muon_fc_update_rms'] = (d.fc.weight.float() - before.float()).pow(2).mean().sqrt().item()
    return r


def _dataset(tmp, n, length, name='data', seed=0):
    "`n` random samples of `length` tokens (a random target makes no use of real text), loss on the second half, saved in `tmp/name`."
    import numpy as np
    from dflash.data import TokenizedDataset
    g = np.random.default_rng(seed)
    return TokenizedDataset.from_samples([dict(id=f's{i}', input_ids=g.integers(10, 2000, length).astype(np.int32),
                                               loss_mask=(np.arange(length) >= length // 2).astype(np.uint8)) for i in range(n)]).save(tmp / name)


def check_extract(a, torch, dev, tok, tmp):
    from transformers import AutoModelForCausalLM
    from dflash.taps import capture, pad_batch, tap_layers, StopForward, default_layer_ids
    from dflash.extract import extract
    from dflash.extracted import ExtractedDataset
    from dflash.batching import token_budget_batches
    from dflash.plan import target_flops_per_token
    cfg = hybrid_config(tok, a.cpu)
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev.type == 'cuda' else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(dev, dt).eval().requires_grad_(False)
    model.save_pretrained(tmp / 'target'); tok.save_pretrained(tmp / 'target')
    n, length = (32, 128) if a.cpu else (256, 1024)
    ds = _dataset(tmp, n, length)
    ids_layers = default_layer_ids(cfg.num_hidden_layers)
    budget = 1024 if a.cpu else 32768
    batches = token_budget_batches(ds.lengths, budget)
    def bare():
        for bt in batches:
            x, m, _ = pad_batch([ds[i]['input_ids'] for i in bt])
            with tap_layers(model, [max(ids_layers)]), torch.no_grad():
                try: model(input_ids=x.to(dev), attention_mask=m.to(dev), use_cache=False)
                except StopForward: pass
    def naive(k):
        for i in range(k):
            with torch.no_grad(): hs = model(torch.as_tensor(ds[i]['input_ids'], dtype=torch.long)[None].to(dev), output_hidden_states=True).hidden_states
            torch.cat([hs[j + 1] for j in ids_layers], -1).cpu()
    bare(); t0 = sync(torch); bare(); t_bare = sync(torch) - t0
    k = min(n, 32); t0 = sync(torch); naive(k); t_naive = (sync(torch) - t0) * n / k
    t0 = sync(torch)
    r = extract(target=str(tmp / 'target'), data=str(tmp / 'data'), out=str(tmp / 'x'), gpus=1 if dev.type == 'cuda' else 0, token_budget=budget,
                layer_ids=ids_layers, progress=False, model=model, dtype='bf16' if dev.type == 'cuda' else None)
    t_ours = sync(torch) - t0
    assert r['complete'] and r['num_samples'] == n
    xds, worst = ExtractedDataset(tmp / 'x', verify=True), 0.0                 # what is stored is what the target computes
    for i in range(4):
        with torch.no_grad(): want = capture(model, torch.as_tensor(ds[i]['input_ids'], dtype=torch.long)[None].to(dev), layer_ids=ids_layers)[0].cpu()
        got = xds.get(i)['hidden_states']
        assert got.shape == want.shape, (got.shape, want.shape)
        worst = max(worst, ((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
    assert worst <= (2e-2 if dt == torch.bfloat16 else 1e-5), f'stored hidden states differ from a direct capture by {worst:.2e}'
    tokens = int(ds.lengths.sum())
    pk, f = peak(torch), target_flops_per_token(cfg, ids_layers, length) * tokens
    out = dict(params=sum(p.numel() for p in model.parameters()), tokens=tokens, ours_tokens_per_s=tokens / t_ours, bare_tokens_per_s=tokens / t_bare,
               naive_tokens_per_s=tokens / t_naive, ours_over_bare=t_bare / t_ours, ours_over_naive=t_naive / t_ours,
               mfu=f / t_ours / pk if pk else None, stored_vs_capture=worst)
    if dev.type == 'cuda' and torch.cuda.device_count() >= 2:      # one worker process per GPU
        g = torch.cuda.device_count()
        r = extract(target=str(tmp / 'target'), data=str(tmp / 'data'), out=str(tmp / 'xg'), gpus=g, token_budget=budget, layer_ids=ids_layers, progress=False)
        assert r['complete'] and r['workers'] == g and r['num_samples'] == n
        out[f'gpus={g} tokens_per_s'] = r['tokens_per_s']
    else: out['gpus=N'] = 'skipped: needs 2 GPUs'
    return out


def check_budget(a, torch, dev, tok, tmp):
    from dflash.data import TokenizedDataset
    from dflash.extract import Extractor, extract
    from transformers import AutoModelForCausalLM
    ds = TokenizedDataset.load(tmp / 'data')
    model = AutoModelForCausalLM.from_pretrained(tmp / 'target', dtype=torch.bfloat16 if dev.type == 'cuda' else torch.float32).to(dev).eval()
    out = {}
    if dev.type == 'cuda':
        out['auto_budget'] = Extractor(model, ds, [1, 2]).probe_budget()
        free, total = torch.cuda.mem_get_info()
        hog = torch.empty(int(free * 0.97), dtype=torch.uint8, device=dev)      # leave little: the first big batch must fail
        try: r = extract(target=str(tmp / 'target'), data=str(tmp / 'data'), out=str(tmp / 'oom'), gpus=1, token_budget=1 << 20, layer_ids=[1, 2],
                         progress=False, model=model, dtype='bf16')
        finally: del hog; torch.cuda.empty_cache()
    else:
        r = extract(target=str(tmp / 'target'), data=str(tmp / 'data'), out=str(tmp / 'oom'), token_budget=1 << 20, layer_ids=[1, 2],
                    progress=False, model=model, mem_limit_tokens=int(ds.lengths.max()) * 3)
    out.update(ooms=len(r['ooms']), complete=r['complete'], samples=r['num_samples'])
    assert r['complete'] and r['ooms'] and r['num_samples'] == len(ds)
    return out


def _train_kw(tmp, **over):
    "A small run on the random target, every setting the recipe would choose given explicitly."
    return {**dict(target=str(tmp / 'target'), layer_ids=[1, 2], num_layers=1, num_anchors=16, token_budget=1024, max_batch_size=8, log_every=1,
                   final_eval=False, progress=False, lr=1e-3, warmup=0, min_lr_ratio=0.1, weight_decay=0.0, epochs=1.0, max_length=4096,
                   mask_token_id=3, servable=False, val_tree_budgets='none'), **over}


def check_train(a, torch, dev, tok, tmp):
    "Offline training with the held-out reading, then a resume from its middle checkpoint against the uninterrupted run."
    from safetensors.torch import load_file
    from dflash.core import read_metrics
    from dflash.extract import extract
    from dflash.train import train
    x = extract(target=str(tmp / 'target'), data=str(tmp / 'data'), out=str(tmp / 'xt'), layer_ids=[1, 2], token_budget=1024, max_samples=24,
                progress=False, gpus=1 if dev.type == 'cuda' else 0)
    _dataset(tmp, 8, 128 if a.cpu else 1024, 'held-out', seed=1)
    v = extract(target=str(tmp / 'target'), data=str(tmp / 'held-out'), out=str(tmp / 'xv'), layer_ids=[1, 2], token_budget=1024, progress=False,
                gpus=1 if dev.type == 'cuda' else 0)
    assert x['complete'] and v['complete']
    kw = _train_kw(tmp, extracted=x['out'], val_extracted=v['out'], drafters=1, max_steps=6, ckpt_every=3, eval_every=3, keep=3)
    r = train(out=str(tmp / 'off'), **kw)
    loss = {m['step']: m['loss'] for m in read_metrics(tmp / 'off') if 'loss' in m}
    val = [m for m in read_metrics(tmp / 'off') if 'val_tau' in m]
    assert r['step'] == 6 and sorted(loss) == list(range(1, 7)) and all(map(lambda z: z == z and abs(z) < 1e4, loss.values()))
    assert val and all(1 <= m['val_tau'] <= 16 for m in val)
    shutil.copytree(tmp / 'off', tmp / 'res')                          # the same run, stopped after its checkpoint at step 3
    shutil.rmtree(tmp / 'res' / 'checkpoints' / 'step-6'); shutil.rmtree(tmp / 'res' / 'drafter', ignore_errors=True)
    (tmp / 'res' / 'result.json').unlink(missing_ok=True)
    train(out=str(tmp / 'res'), resume=True, **kw)
    again = {m['step']: m['loss'] for m in read_metrics(tmp / 'res') if 'loss' in m}
    rel = max(abs(again[s] - loss[s]) / max(abs(loss[s]), 1e-9) for s in (4, 5, 6))
    w0, w1 = (load_file(tmp / d / 'checkpoints' / 'step-6' / 'model.safetensors') for d in ('off', 'res'))
    wrel = max(((w0[k].float() - w1[k].float()).abs().max() / w0[k].float().abs().max().clamp_min(1e-12)).item() for k in w0)
    exact = dev.type == 'cpu' or torch.are_deterministic_algorithms_enabled()     # a GPU's atomics may reorder sums otherwise
    if exact: assert again[4] == loss[4], f'the first step after the resume differs: {again[4]} != {loss[4]}'
    assert rel <= 1e-3 and wrel <= 1e-3, (rel, wrel)
    return dict(steps=r['step'], first_loss=loss[1], last_loss=loss[6], val_tau=val[-1]['val_tau'], resume_max_relative_loss_difference=rel,
                resume_max_relative_weight_difference=wrel, resume_first_step='bit-exact' if exact else 'within 1e-3 (kernels not deterministic)')


def check_online(a, torch, dev, tok, tmp):
    "The embedded target (trained: its replies can be learnt) feeding one drafter rank through the HS queue, under a byte bound of 3 batches."
    from dflash.core import read_metrics, TINY_TARGET
    from dflash.train import train
    q_gb = 3 * 1024 * 256 * 4 / 2**30                                   # three batches of 1,024 tokens of one 256-wide tap in fp32
    kw = dict(target=str(TINY_TARGET), out=str(tmp / 'on11'), targets=1, drafters=1, max_steps=16, ckpt_every=0, q_gb=q_gb, lr=3e-3,
              num_layers=1, num_anchors=16, token_budget=1024, max_samples=160, log_every=1, final_eval=False, progress=False, warmup=0,
              min_lr_ratio=0.1, weight_decay=0.01, epochs=2.0, val_data='none')
    r = train(**kw)
    ms = [m for m in read_metrics(tmp / 'on11') if 'loss' in m]
    first, last = sum(m['loss'] for m in ms[:3]) / 3, sum(m['loss'] for m in ms[-3:]) / 3
    peak_q = max(m['q_peak_bytes'] for m in ms)
    assert r['step'] == 16 and last < first - 0.5, (first, last)
    assert 0 < peak_q <= ms[-1]['q_bytes_capacity'], (peak_q, ms[-1]['q_bytes_capacity'])
    out = {'1+1 steps': r['step'], 'loss first/last 3': f'{first:.3f}/{last:.3f}', 'queue peak / bound MiB': f'{peak_q / 2**20:.2f}/{q_gb * 1024:.2f}'}
    if dev.type == 'cuda' and torch.cuda.device_count() >= 4:
        r = train(**dict(kw, out=str(tmp / 'on22'), targets=2, drafters=2, max_steps=6))
        assert r['step'] == 6; out['2+2 (NCCL, DDP) steps'] = r['step']
    else: out['2+2'] = 'skipped: needs 4 GPUs for NCCL between ranks of their own and DDP with 2 drafter ranks'
    return out


def check_stop(a, torch, dev, tok, tmp):
    "An online job that would run for ages; SIGTERM to its drafter rank: every rank ends within seconds, with a checkpoint at its step."
    from dflash.core import read_metrics
    from dflash.checkpoint import latest_checkpoint
    out = tmp / 'stop'
    kw = _train_kw(tmp, data=str(tmp / 'data'), out=str(out), targets=1, drafters=1, max_steps=100000, epochs=100, ckpt_every=0, q_depth=64)
    code = f"from dflash.train import train; import json; print(json.dumps(train(**{kw!r})))"
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while len(read_metrics(out)) < 3 and p.poll() is None and time.time() - t0 < TIMEOUT['stop']: time.sleep(0.2)
    assert p.poll() is None, p.stdout.read()[-2000:]
    t_stop = time.time(); os.kill(int((out / 'logs' / 'rank-1.pid').read_text()), signal.SIGTERM)
    text, _ = p.communicate(timeout=TIMEOUT['stop'])
    secs = time.time() - t_stop
    assert p.returncode == 0, text[-2000:]
    res = json.loads(text.strip().splitlines()[-1])
    assert res['stopped'] == 'signal' and latest_checkpoint(out).name == f"step-{res['step']}" and secs < 30, (res, secs)
    return dict(stopped_at_step=res['step'], seconds_to_end=secs)


def seeds_target(torch, tok, path):
    """The seeds' target at reduced depth: the shipped 27B hybrid config's text model (hidden 5120, its 248,320-token head, gated
    DeltaNet and full attention) with its first 4 layers, random weights in bf16, saved with the tokenizer at `path`."""
    from transformers import AutoModelForCausalLM
    from dflash.plan import HYBRID_27B_DEFAULT
    from dflash.taps import load_target_config, text_config
    tc = text_config(load_target_config(HYBRID_27B_DEFAULT))
    tc.num_hidden_layers, tc.layer_types = 4, tc.layer_types[:4]
    assert 'full_attention' in tc.layer_types and 'linear_attention' in tc.layer_types, tc.layer_types
    torch.manual_seed(0)
    with torch.device('cuda'): m = AutoModelForCausalLM.from_config(tc, dtype=torch.bfloat16)
    m.save_pretrained(path); tok.save_pretrained(path)
    del m; torch.cuda.empty_cache()                                    # the ranks plan for the whole GPU: free it
    return path


def check_seeds(a, torch, dev, tok, tmp):
    """The seeds' job at reduced depth, online, one target and one drafter rank sharing the GPU, every setting the recipe's and the
    memory plan's (the CPU: the toy hybrid, a stated GPU of 24 GB); SIGTERM after its first steps; each rank's peak against the plan."""
    from dflash.core import read_metrics
    from dflash.checkpoint import latest_checkpoint
    target = tmp / 'target' if a.cpu else seeds_target(torch, tok, tmp / 'seeds-target')
    out = tmp / 'seeds'
    kw = dict(target=str(target), data=str(tmp / 'data'), out=str(out), targets=1, drafters=1, layer_ids=[1, 2], mask_token_id=3,
              servable=False, final_eval=False, progress=False, max_steps=100000, epochs=100.0, ckpt_every=0, val_data='none', log_every=1,
              **(dict(gpus=1, gpu_mem_gb=24.0, num_layers=1, num_anchors=16) if a.cpu else dict(num_layers=2)))
    code = f"from dflash.train import train; import json; print(json.dumps(train(**{kw!r})))"
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not [m for m in read_metrics(out) if 'loss' in m] and p.poll() is None and time.time() - t0 < TIMEOUT['seeds']: time.sleep(0.5)
    assert p.poll() is None, p.stdout.read()[-2000:]
    os.kill(int((out / 'logs' / 'rank-1.pid').read_text()), signal.SIGTERM)
    text, _ = p.communicate(timeout=TIMEOUT['seeds'])
    assert p.returncode == 0, text[-2000:]
    res, run = json.loads(text.strip().splitlines()[-1]), json.loads((out / 'run.json').read_text())
    mem, cfg, orig = run['memory'], run['config'], run['origins']
    assert res['stopped'] == 'signal' and latest_checkpoint(out).name == f"step-{res['step']}", res
    assert mem['planned'] and orig['token_budget'].startswith('the memory plan') and cfg['token_budget'] == mem['token_budget'], (mem, orig)
    ms = [m for m in read_metrics(out) if 'loss' in m]
    assert all(m['loss'] == m['loss'] for m in ms), 'a loss is not finite'
    peak = sum(ms[-1].get('mem', {}).values())                         # both ranks' peaks: they share the GPU
    r = dict(steps=res['step'], token_budget=cfg['token_budget'], grad_ckpt=cfg['grad_ckpt'], planned_gb=mem['drafter_rank_gb'])
    if not a.cpu:
        r['measured_gb'] = peak / 1e9; r['measured / planned'] = peak / 1e9 / mem['drafter_rank_gb']
        assert peak / 1e9 <= (1 + cfg['headroom']) * mem['drafter_rank_gb'], r    # the plan may fall short by its headroom, no more
    return r


def check_lossless(a, torch, dev, tok):
    from transformers import AutoConfig, AutoModelForCausalLM
    from dflash.core import TINY_TARGET
    from dflash.evaluate import greedy_decode, load_prompts, spec_decode, evaluate, DFlashDrafter
    from dflash.verify import tree_verify_cost
    from dflash.model import DFlashDraftModel, drafter_config
    ps, out = load_prompts(tok, n=16), {}
    bf = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.bfloat16).to(dev).eval()   # the loop in bf16: near-ties allowed
    torch.manual_seed(0)
    d = DFlashDraftModel(drafter_config(bf.config, 1, 16, tok.mask_token_id, [1, 2])).to(dev, torch.bfloat16).attach_target(bf).eval()
    r = evaluate(bf, d, [ps[i] for i in ((5, 6, 9) if a.cpu else range(16))], 40, strict=True)
    assert r['lossless'], 'the bf16 loop parted from the target other than at a near-tie'
    out['bf16 loop identical / lossless'] = f"{sum(p['identical'] for p in r['per_prompt'])}/{len(r['per_prompt'])}"
    qc = AutoConfig.for_model('qwen3', vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    targets = dict(qwen3=AutoModelForCausalLM.from_config(qc).to(dev).eval(),
                   hybrid=AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).to(dev).eval())
    prompt = ps[0]
    for name, t in targets.items():
        d = DFlashDraftModel(drafter_config(t.config, 1, 16, tok.mask_token_id, [1, 2])).to(dev).attach_target(t).eval()
        want = greedy_decode(t, prompt, 32)
        for n in (16, 64):
            got, steps = spec_decode(t, DFlashDrafter(d), prompt, 32, block_size=16, tree_budget=n)
            assert got == want, f'{name}: tree {n} parts from the greedy output at {next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)}'
            out[f'{name} tree {n} tau'] = sum(x + 1 for x, _ in steps) / len(steps)
        c = tree_verify_cost(t, prompt, (4, 16, 64), 16, reps=5)
        out[f'{name} ms decode/chain/tree 4/16/64'] = '/'.join(f'{x * 1e3:.2f}' for x in (c['decode_s'], c['chain_s'], *c['tree_s'].values()))
    return out


class CompileClock:
    "Seconds this process has spent compiling (dynamo and inductor, from dynamo's start and end callbacks), a compile under way included."
    def __init__(self):
        self.total, self.depth, self.since, self.lock = 0.0, 0, None, threading.Lock()
        try:
            from torch._dynamo.callback import on_compile_start, on_compile_end
            on_compile_start(self._start); on_compile_end(self._end)
        except ImportError: pass                                   # an older torch: compiles count against the timeout
    def _start(self, *_):
        with self.lock:
            if self.depth == 0: self.since = time.time()
            self.depth += 1
    def _end(self, *_):
        with self.lock:
            self.depth = max(0, self.depth - 1)
            if self.depth == 0 and self.since is not None: self.total += time.time() - self.since; self.since = None
    def seconds(self):
        with self.lock: return self.total + (time.time() - self.since if self.since is not None else 0.0)


def _children():
    """This process's descendants (psutil), but inductor's compile workers, which torch keeps for the whole process (killed, the next
    compile would wait on them for ever); an empty list where psutil is missing."""
    try: import psutil
    except ImportError: return []
    def ours(p):
        try: return 'compile_worker' not in ' '.join(p.cmdline())
        except Exception: return False
    pool = {q.pid for p in psutil.Process().children() if not ours(p) for q in [p, *p.children(recursive=True)]}
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in pool]


class Timeout(BaseException):
    "A check over its timeout (a BaseException: no `except Exception` inside a check swallows it)."

_ARMED = {}                                                     # the running check's message while its deadline is armed

def _fire(*_):
    if msg := _ARMED.get('msg'): raise Timeout(msg)


@contextlib.contextmanager
def deadline(seconds, clock):
    """Raise `Timeout` in this (the main) thread once `seconds` have passed, not counting compiling in this process (`clock`): a
    watching thread sends SIGUSR1 every second until the block ends, and the handler raises only while the block's deadline is armed
    (a late signal does nothing). Then, whatever happened, the processes the block started are killed and waited for. Yields a dict
    that gets `compile_s`."""
    info, done, t0, c0 = {}, threading.Event(), time.time(), clock.seconds()
    before = {p.pid for p in _children()}
    if signal.getsignal(signal.SIGUSR1) is not _fire: signal.signal(signal.SIGUSR1, _fire)
    def watch():
        while not done.wait(0.5):
            if time.time() - t0 - (clock.seconds() - c0) > seconds: os.kill(os.getpid(), signal.SIGUSR1); done.wait(0.5)
    _ARMED['msg'] = f'over its timeout of {seconds} s (compiling in this process not counted)'
    threading.Thread(target=watch, daemon=True).start()
    try: yield info
    finally:
        _ARMED.pop('msg', None); done.set(); info['compile_s'] = round(clock.seconds() - c0, 1)
        left = [p for p in _children() if p.pid not in before]
        for p in left:
            try: p.kill()
            except Exception: pass
        if left:
            import psutil
            psutil.wait_procs(left, timeout=30)


def table(report):
    "The report as a markdown table for BENCHMARKS.md."
    md = [f"GPU check ({report['machine']['mode']}): {report['machine']}", '', '| check | status | seconds (est.) | compiling s | figures |',
          '|---|---|---:|---:|---|']
    md += [f"| {k} | {v['status']} | {v['seconds']} ({ESTIMATE[k]}) | {v.get('compile_s', 0)} | " + ', '.join(
           f'{x}: {y:.4g}' if isinstance(y, float) else f'{x}: {y}' for x, y in v.items() if x not in ('status', 'seconds', 'compile_s', 'traceback'))
           + ' |' for k, v in report['checks'].items()]
    md += ['', f"total {report['seconds']:.0f} s against an estimate of {report['estimate_s']} s (compiling {report['compile_s']:.0f} s of it)"]
    return '\n'.join(md) + '\n'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--cpu', action='store_true', help='the reduced form, on the CPU')
    p.add_argument('--out', default=str(ROOT / 'runs' / 'gpu-check'))
    p.add_argument('--only', default=','.join(ESTIMATE))
    p.add_argument('--part', type=int, choices=sorted(PARTS), help='one of the two parts, each within a device call (see PARTS)')
    p.add_argument('--limit', type=float, default=None, help=f'refuse to start when the estimate is over this many seconds '
                   f'(default: {LIMIT} with --part)')
    a = p.parse_args(argv)
    if a.cpu: os.environ['DFLASH_DEVICE'] = 'cpu'
    else: os.environ.pop('DFLASH_DEVICE', None)
    import torch
    from transformers import AutoTokenizer
    from dflash.core import TINY_TARGET
    from dflash.taps import environment
    if not a.cpu and not torch.cuda.is_available(): sys.exit('gpu_check: no GPU here; --cpu runs the reduced form')
    dev = torch.device('cpu' if a.cpu else 'cuda:0')
    names = list(PARTS[a.part]) if a.part else a.only.split(',')
    if bad := [n for n in names if n not in ESTIMATE]: sys.exit(f'gpu_check: no check {bad}; the checks: {", ".join(ESTIMATE)}')
    print(environment(), flush=True)
    scale = 3 if a.cpu else 1                                            # the CPU's reduced form: toy shapes on 2 cores
    est = sum(ESTIMATE[n] for n in names)
    limit = a.limit if a.limit is not None else LIMIT if a.part else None
    if limit is not None and not a.cpu and est > limit:
        sys.exit(f'gpu_check: the estimate of {est} s is over the limit of {limit:g} s: run it in parts (--part 1, then --part 2)')
    print(f"estimated {est / 60:.1f} min {'for the GPU form ' if a.cpu else ''}on one H100 or H200 (per check: {ESTIMATE}; each times out "
          f"at {2 * scale}x its estimate, compiling not counted)", flush=True)
    tok, tmp = AutoTokenizer.from_pretrained(TINY_TARGET), Path(tempfile.mkdtemp(prefix='gpu-check-'))
    checks = dict(flex=lambda: check_flex(a, torch, dev), step=lambda: check_step(a, torch, dev),
                  extract=lambda: check_extract(a, torch, dev, tok, tmp), budget=lambda: check_budget(a, torch, dev, tok, tmp),
                  train=lambda: check_train(a, torch, dev, tok, tmp), online=lambda: check_online(a, torch, dev, tok, tmp),
                  stop=lambda: check_stop(a, torch, dev, tok, tmp), lossless=lambda: check_lossless(a, torch, dev, tok),
                  seeds=lambda: check_seeds(a, torch, dev, tok, tmp))
    needs_target = {'budget', 'train', 'online', 'stop', 'seeds'}
    if needs_target & set(names) and 'extract' not in names: names.insert(0, 'extract')     # they read its target and data
    report = dict(machine=dict(gpu=torch.cuda.get_device_name() if not a.cpu else None, torch=torch.__version__, python=platform.python_version(),
                               cpus=os.cpu_count(), mode='cpu (reduced)' if a.cpu else 'gpu'), checks={}, estimate_s=est)
    clock, t_all, out = CompileClock(), time.time(), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name in names:
            t0 = time.time()
            try:
                with deadline(TIMEOUT[name] * scale, clock) as info: res = dict(status='passed', **checks[name]())
            except (Exception, Timeout) as e:
                res = dict(status='failed', error=f'{type(e).__name__}: {e}'[:500], traceback=traceback.format_exc()[-2000:])
            res['seconds'], res['compile_s'] = round(time.time() - t0, 1), info.get('compile_s', 0.0)
            report['checks'][name] = res
            (out / 'gpu-check.json').write_text(json.dumps(report, indent=1, default=str))   # what a killed run leaves: every check so far
            print(f"{name:8s} {res['status']:7s} {res['seconds']:6.1f}s  " + json.dumps({k: v for k, v in res.items() if k not in ('status', 'seconds', 'traceback')}, default=str), flush=True)
    finally: shutil.rmtree(tmp, ignore_errors=True)
    report['seconds'], report['compile_s'] = time.time() - t_all, clock.seconds()
    (out / 'gpu-check.json').write_text(json.dumps(report, indent=1, default=str))
    (out / 'gpu-check.md').write_text(table(report))
    print(table(report))
    return 0 if all(v['status'] == 'passed' for v in report['checks'].values()) else 1


if __name__ == '__main__':
    sys.exit(main())
