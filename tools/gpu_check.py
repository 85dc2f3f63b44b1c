"""One check of every GPU path, in one script (about 8 minutes on one H200), with a report to paste into BENCHMARKS.md.

    .venv/bin/python tools/gpu_check.py [--out runs/gpu-check]        on a machine with a GPU
    .venv/bin/python tools/gpu_check.py --cpu                           the same paths in a reduced form, on a CPU (make test)

Checks, each recorded as passed, failed (with the error) or skipped (with why):
1. flex:     the drafter's block-masked attention (a sliding layer and a full one) through flex_attention (compiled on a GPU) against SDPA: the same loss
             and gradients within tolerance.
2. step:     a bf16 drafter training step at a real target's shapes (Qwen3-8B's: hidden 4096, 151936 tokens, 5 layers):
             tokens/s and model FLOPs utilisation (MFU) against the GPU's peak; then the same step with the drafter
             compiled (torch.compile, dynamic shapes): compiled / eager decides TrainConfig.compile's default.
3. extract:  extraction of a random-weight ~1.5B qwen3_5 hybrid in bf16: ours (`extract`) against the naive recipe
             (output_hidden_states, one sample at a time) and the bare forward to the last tap; aims ours >= 0.95 of
             bare and >= 50x naive; MFU.
4. budget:   the 'auto' token-budget probe, then a CUDA out-of-memory forced by filling the GPU, which the split-and-retry
             survives with every sample extracted.
5. online:   the 1+1 online pipeline on one GPU (the two ranks share it through gloo); with 2+ GPUs the NCCL pipeline and
             DDP with 2 drafter ranks (skipped, with a message, on one GPU).
6. tree:     DDTree verification (`spec_decode(tree_budget=N)`) on the device, fp32: a random-weight Qwen3 (the flattened tree under a
             4-D additive mask through SDPA) and the embedded Qwen3.5 hybrid (one row per root-to-leaf path): greedy outputs equal
             the target's own at budgets 16 and 64; then a tree verify's cost against a chain verify and a plain decode.
Writes OUT/gpu-check.json and OUT/gpu-check.md; exits 1 if any check failed.
"""
import argparse, json, os, platform, sys, tempfile, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12}   # dense bf16 TFLOP/s, the spec sheets'


def peak(torch):
    if not torch.cuda.is_available(): return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(torch):
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return time.perf_counter()


def hybrid_config(tok, cpu):
    "A qwen3_5 hybrid text config: ~1.5B parameters on a GPU, toy-sized on a CPU."
    from dflash.tiny_target import target_config
    if cpu: return target_config(tok, hidden=64, layers=4)
    c = target_config(tok, hidden=2048, layers=24)
    c.vocab_size = 151936
    return c


def check_flex(a, torch, dev):
    from dflash.model import DFlashDraftModel, drafter_config
    from transformers import Qwen3Config
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
    return dict(loss_sdpa=ls, loss_flex=lf, max_relative_grad_difference=worst)


def check_step(a, torch, dev):
    "A training step at Qwen3-8B's drafter shapes in bf16 (GPU), or a tiny one (CPU): tokens/s and MFU."
    from transformers import Qwen3Config
    from dflash.model import DFlashDraftModel, drafter_config
    from dflash.plan import drafter_flops_per_token
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
    auto = torch.autocast('cuda', dtype=torch.bfloat16) if dev.type == 'cuda' else torch.autocast('cpu', enabled=False)
    A = 32 if a.cpu else 512
    def step():
        with auto: o = d(hs, ids, lm, num_anchors=A)
        o.loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
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
    return r


def _dataset(tmp, tok, n, length):
    "`n` random samples of `length` tokens (a random target makes no use of real text), loss on the second half."
    import numpy as np
    from dflash.data import TokenizedDataset
    g = np.random.default_rng(0)
    return TokenizedDataset.from_samples([dict(id=f's{i}', input_ids=g.integers(10, 2000, length).astype(np.int32),
                                               loss_mask=(np.arange(length) >= length // 2).astype(np.uint8)) for i in range(n)]).save(tmp / 'data')


def check_extract(a, torch, dev, tok, tmp):
    from transformers import AutoModelForCausalLM
    from dflash.taps import capture, pad_batch, tap_layers, StopForward, default_layer_ids
    from dflash.extract import extract
    from dflash.batching import token_budget_batches
    cfg = hybrid_config(tok, a.cpu)
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev.type == 'cuda' else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(dev, dt).eval().requires_grad_(False)
    model.save_pretrained(tmp / 'target'); tok.save_pretrained(tmp / 'target')
    n, length = (32, 128) if a.cpu else (256, 1024)
    ds = _dataset(tmp, tok, n, length)
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
    tokens = int(ds.lengths.sum())
    from dflash.plan import target_flops_per_token
    pk, f = peak(torch), target_flops_per_token(cfg, ids_layers, length) * tokens
    out = dict(params=sum(p.numel() for p in model.parameters()), tokens=tokens, ours_tokens_per_s=tokens / t_ours, bare_tokens_per_s=tokens / t_bare,
               naive_tokens_per_s=tokens / t_naive, ours_over_bare=t_bare / t_ours, ours_over_naive=t_naive / t_ours,
               mfu=f / t_ours / pk if pk else None, complete=r['complete'])
    assert r['complete']
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


def check_online(a, torch, dev, tok, tmp):
    from dflash.train import train
    common = dict(target=str(tmp / 'target'), data=str(tmp / 'data'), layer_ids=[1, 2], num_layers=1, num_anchors=16, token_budget=2048,
                  max_steps=6, log_every=1, ckpt_every=0, final_eval=False, progress=False, lr=1e-3, warmup=0, min_lr_ratio=0.1,
                  weight_decay=0.0, epochs=1.0, max_length=4096)
    r = train(out=str(tmp / 'on11'), targets=1, drafters=1, **common)
    out = {'1+1 steps': r['step']}
    assert r['step'] == 6
    if dev.type == 'cuda' and torch.cuda.device_count() >= 2:
        r = train(out=str(tmp / 'on22'), targets=2, drafters=2, **common); out['2+2 (NCCL, DDP) steps'] = r['step']
    else: out['2+ GPUs'] = 'skipped: needs 2 GPUs for the NCCL pipeline and DDP with 2 drafter ranks'
    return out


def check_tree(a, torch, dev, tok):
    from transformers import AutoConfig, AutoModelForCausalLM
    from dflash.core import TINY_TARGET
    from dflash.evaluate import greedy_decode, load_prompts, spec_decode, DFlashDrafter
    from dflash.verify import tree_verify_cost
    from dflash.model import DFlashDraftModel, drafter_config
    torch.manual_seed(0)
    qc = AutoConfig.for_model('qwen3', vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    targets = dict(qwen3=AutoModelForCausalLM.from_config(qc).to(dev).eval(),
                   hybrid=AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).to(dev).eval())
    prompt, out = load_prompts(tok, n=1)[0], {}
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--cpu', action='store_true', help='the reduced form, on the CPU')
    p.add_argument('--out', default=str(ROOT / 'runs' / 'gpu-check'))
    p.add_argument('--only', default='flex,step,extract,budget,online,tree')
    a = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer
    from dflash.core import TINY_TARGET
    if not a.cpu and not torch.cuda.is_available(): sys.exit('gpu_check: no GPU here; --cpu runs the reduced form')
    dev = torch.device('cpu' if a.cpu else 'cuda:0')
    tok, tmp = AutoTokenizer.from_pretrained(TINY_TARGET), Path(tempfile.mkdtemp(prefix='gpu-check-'))
    checks = dict(flex=lambda: check_flex(a, torch, dev), step=lambda: check_step(a, torch, dev),
                  extract=lambda: check_extract(a, torch, dev, tok, tmp), budget=lambda: check_budget(a, torch, dev, tok, tmp),
                  online=lambda: check_online(a, torch, dev, tok, tmp), tree=lambda: check_tree(a, torch, dev, tok))
    report = dict(machine=dict(gpu=torch.cuda.get_device_name() if not a.cpu else None, torch=torch.__version__, python=platform.python_version(),
                               cpus=os.cpu_count(), mode='cpu (reduced)' if a.cpu else 'gpu'), checks={})
    for name in a.only.split(','):
        t0 = time.time()
        try: res = dict(status='passed', **checks[name]())
        except Exception as e: res = dict(status='failed', error=f'{type(e).__name__}: {e}'[:500], traceback=traceback.format_exc()[-2000:])
        res['seconds'] = round(time.time() - t0, 1)
        report['checks'][name] = res
        print(f"{name:8s} {res['status']:7s} {res['seconds']:6.1f}s  " + json.dumps({k: v for k, v in res.items() if k not in ('status', 'seconds', 'traceback')}), flush=True)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    (out / 'gpu-check.json').write_text(json.dumps(report, indent=1, default=str))
    md = [f"GPU check ({report['machine']['mode']}): {report['machine']}", '', '| check | status | seconds | figures |', '|---|---|---:|---|']
    md += [f"| {k} | {v['status']} | {v['seconds']} | " + ', '.join(f'{x}: {y:.4g}' if isinstance(y, float) else f'{x}: {y}'
           for x, y in v.items() if x not in ('status', 'seconds', 'traceback')) + ' |' for k, v in report['checks'].items()]
    (out / 'gpu-check.md').write_text('\n'.join(md) + '\n')
    print('\n'.join(md))
    return 0 if all(v['status'] == 'passed' for v in report['checks'].values()) else 1


if __name__ == '__main__':
    sys.exit(main())
