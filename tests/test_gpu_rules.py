"""CUDA's rules, held on a CPU: what a first GPU run would meet, each checked here where no GPU is. Compiled flex attention that
does not recompile per shape, masks and buffers bounded in bytes, RNG states on the host, NCCL's blocking receives."""
import itertools, subprocess, sys, textwrap
import pytest, torch, torch._dynamo
import dflash.blocks as blocks
from dflash.model import DFlashDraftModel, drafter_config
from transformers import Qwen3Config

H, V = 64, 256


@pytest.fixture
def hybrid():
    "A drafter of a sliding layer and a full one (the two mask kinds of the published layout), frozen: flex has no backward on a CPU."
    tc = Qwen3Config(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=V)
    torch.manual_seed(0)
    d = DFlashDraftModel(drafter_config(tc, 2, 16, 5, [1, 4], layer_types=['sliding_attention', 'full_attention'], sliding_window=32))
    d.attach_target(embed_tokens=torch.nn.Embedding(V, H).requires_grad_(False), lm_head=torch.nn.Linear(H, V, bias=False).requires_grad_(False))
    return d.requires_grad_(False).eval()


def _batch(b, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, S, 2 * H, generator=g), torch.randint(0, V, (b, S), generator=g), torch.ones(b, S, dtype=torch.long)


def test_compiled_flex_does_not_recompile_per_shape(hybrid, monkeypatch):
    """A run calls flex with every batch's shape, both mask kinds, autocast on (training) and off (the held-out reading), gradients on and
    off. The compiled function (dynamo, 'eager' backend: the same guards as inductor's) reaches a fixed set of graphs, within its limit,
    and new shapes add none. Before: the mask's length and window were guarded constants, autocast a guard of its own: past the limit (8)
    flex ran uncompiled."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(blocks, 'FLEX_BACKEND', 'eager')
    monkeypatch.setattr(torch._dynamo.config, 'fail_on_recompile_limit_hit', True)    # past the limit: an error, not a quiet fall back
    torch._dynamo.reset()

    def sweep(shapes):
        for b, S, A in shapes:
            hs, ids, lm = _batch(b, S, seed=S)
            for grad, amp in itertools.product((True, False), (True, False)):
                with torch.set_grad_enabled(grad), torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
                    hybrid(hs, ids, lm, num_anchors=A, attn_impl='flex')
        return counters['stats']['unique_graphs']
    n0 = counters['stats']['unique_graphs']
    n1 = sweep([(b, S, A) for b, (S, A) in itertools.product((1, 2, 3), ((40, 1), (64, 2), (96, 3), (130, 9), (200, 12)))])
    n2 = sweep([(4, 150, 5), (5, 260, 17), (1, 77, 4), (2, 333, 30), (3, 50, 2)])
    assert 0 < n1 - n0 <= blocks.FLEX_RECOMPILE_LIMIT and n2 == n1, (n1 - n0, n2 - n1)
    torch._dynamo.reset()


def test_flex_masks_are_built_within_their_bytes(hybrid):
    """The held-out reading's anchors (one at every position) through flex: the masks are built in pieces, none over the drafter's
    `mask_bytes`, and the result is the dense path's. Before: one mask of b x A*B x (S + A*B) elements, 3.4 billion at 5 x 3072 tokens."""
    hs, ids, lm = _batch(3, 96)
    with torch.no_grad():
        dense = hybrid(hs, ids, lm, num_anchors=96, attn_impl='sdpa', return_logits=True)
        hybrid.mask_bytes = 3 * 16 * 8 * (96 + 16 * 8) * blocks.MASK_BYTES_PER_ELEMENT      # 8 anchors a piece
        blocks.MASK_LEDGER.update(built=0, peak_elements=0, scalars=0)
        flex = hybrid(hs, ids, lm, num_anchors=96, attn_impl='flex', return_logits=True)
    assert blocks.MASK_LEDGER['peak_elements'] * blocks.MASK_BYTES_PER_ELEMENT <= hybrid.mask_bytes
    assert blocks.MASK_LEDGER['built'] == 2 * 12 and blocks.MASK_LEDGER['scalars'] == 2   # two mask kinds, 95 anchors in 12 pieces; the scalars once a kind
    assert torch.allclose(flex.logits, dense.logits, atol=1e-4) and torch.equal(flex.labels, dense.labels)


def test_mask_bytes_per_element_is_measured():
    "`MASK_BYTES_PER_ELEMENT` holds: the peak resident growth of building one flex mask, in a fresh process, per element."
    code = textwrap.dedent('''
        import os, resource, torch
        from dflash.blocks import flex_block_mask
        torch.set_num_threads(1)
        b, S, A, B = 2, 2048, 384, 16                                      # 1.2 GB at 10 bytes an element: well above import's peaks
        anchors = torch.sort(torch.randint(0, S - 2, (b, A), generator=torch.Generator().manual_seed(0)), 1).values
        flex_block_mask(anchors[:, :2], S, B, 32, True)                    # warm: the allocator and the code paths
        now = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')    # resident now (the peak so far may be higher)
        flex_block_mask(anchors, S, B, 32, True)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - now) / (b * A * B * (S + A * B)))''')
    per = float(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout)
    assert 4 < per <= blocks.MASK_BYTES_PER_ELEMENT, per


def test_extraction_copies_to_the_host_through_a_ring_of_fixed_bytes(tmp_path, make_target):
    """Every device-to-host copy of an extraction goes through one `HostRing` (pinned on a GPU): its bytes are never exceeded, every span
    comes back, and the shards hold what a run without it holds. Before: a pinned block per batch, kept by torch's cache for every size."""
    import numpy as np
    from dflash.data import TokenizedDataset
    from dflash.batching import token_budget_batches
    from dflash.extract import Extractor, HostRing
    from dflash.shards import ShardWriter, open_out
    from dflash.extracted import ExtractedDataset
    model, g = make_target('qwen3_5'), np.random.default_rng(0)
    ds = TokenizedDataset.from_samples([dict(id=f's{i}', input_ids=g.integers(10, 2000, n).astype(np.int32), loss_mask=np.ones(n, np.uint8))
                                        for i, n in enumerate(g.integers(20, 200, 40))])
    batches = token_budget_batches(ds.lengths, 512)

    def run(out, ring):
        open_out(out, dict(target='t', layer_ids=[1, 3], hidden_size=64, dtype='float32', final_hidden=True))
        with ShardWriter(out, 0, shard_bytes=50_000, depth=1) as w:
            ex = Extractor(model, ds, [1, 3], w, 512, final=True, ring=ring)
            ex.run(batches)
        return ExtractedDataset(out), ex
    plain, _ = run(tmp_path / 'plain', None)
    ring = HostRing(5 * 512 * 3 * 64 * 4 // 2)                        # two and a half of the largest batch (512 rows of 3 x 64 fp32)
    ringed, ex = run(tmp_path / 'ring', ring)
    assert ex.row_bytes() == 3 * 64 * 4 and 0 < ring.peak <= ring.capacity and ring.held == 0 and not ring.spans
    for sid in range(len(ds)):
        a, b = plain.get(sid), ringed.get(sid)
        assert torch.equal(a['hidden_states'], b['hidden_states']) and torch.equal(a['final_hidden'], b['final_hidden'])


def test_the_lossless_loop_in_bf16_allows_near_ties_only(tok):
    """The embedded target in bf16 (on a GPU, its dtype): a verify forward and one-token decoding may round differently, and where the
    speculative output parts from the target's greedy output it must be at a near-tie (a margin of a few bf16 steps). That is lossless
    (`identical` False); a reference from another target is still caught. Whether this CPU's bf16 kernels part anywhere depends on the
    CPU (on some, every prompt is identical), so the near-tie is also made: a reference that takes the target's second choice where it is
    within a near-tie of the first. Before: 'NOT lossless', and `make demo`'s assert."""
    import warnings
    from transformers import AutoModelForCausalLM
    from dflash.core import TINY_TARGET
    from dflash.evaluate import evaluate, load_prompts, greedy_decode, greedy_reference, NEAR_TIE_ULPS
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    d = DFlashDraftModel(drafter_config(target.config, 1, 16, tok.mask_token_id, [1, 2])).to(torch.bfloat16).attach_target(target).eval()
    ps = [load_prompts(tok, n=16)[i] for i in (5, 6, 9)]
    r = evaluate(target, d, ps, 40, strict=True, warmup=False)
    assert r['lossless']
    outs = greedy_reference(target, ps, 40)['outputs']                # as evaluate decodes it: up to the target's EOS
    ties = []                                                         # (gap in bf16 steps, prompt, position, the second choice)
    for k, (p, o) in enumerate(zip(ps, outs)):
        with torch.no_grad(): lg = target(torch.tensor([list(p) + list(o[:-1])])).logits[0, len(p) - 1:].float()
        top = lg.topk(2, -1)
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(top.values[:, 0].abs())))
        gap = (top.values[:, 0] - top.values[:, 1]) / ulp
        i = int(gap[:-1].argmin())                                    # not the last token: the reference goes on after it
        ties.append((float(gap[i]), k, i, next(int(t) for t in top.indices[i] if int(t) != o[i])))   # the choice greedy did not take
    g, k, i, second = min(ties)
    assert g <= NEAR_TIE_ULPS, f'no near-tie in {len(ps)} prompts x 40 tokens (the closest {g:.1f} bf16 steps)'
    tie = [list(o) for o in outs]; tie[k][i] = second
    r = evaluate(target, d, ps, 40, reference=dict(outputs=tie, time_s=[1.0] * 3), warmup=False)
    assert r['lossless'] and not r['per_prompt'][k]['identical']
    other = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.bfloat16).eval()
    with torch.no_grad(): other.lm_head.weight.mul_(-1)                   # its greedy choices are the target's worst
    bad = dict(outputs=[greedy_decode(other, p, 40) for p in ps], time_s=[1.0] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert not evaluate(target, d, ps, 40, reference=bad, warmup=False)['lossless']


def _fake_gpu(tmp_path):
    "A stand-in `nvidia-smi` that lists one GPU: a machine with a GPU that this CPU build of torch cannot use."
    d = tmp_path / 'bin'; d.mkdir()
    (d / 'nvidia-smi').write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'); (d / 'nvidia-smi').chmod(0o755)
    env = {k: v for k, v in __import__('os').environ.items() if k != 'DFLASH_DEVICE'}
    return dict(env, PATH=f"{d}:{env['PATH']}")


@pytest.mark.skipif(torch.cuda.is_available(), reason='torch can use a GPU here')
def test_a_job_on_a_machine_whose_gpus_torch_cannot_use_is_refused(tmp_path):
    """dflash_train on a machine with a GPU and a torch that cannot use it stops at start-up, saying so; with DFLASH_DEVICE=cpu it runs on the
    CPU on purpose. Before: every rank ran on the CPU without a word."""
    env = _fake_gpu(tmp_path)
    cmd = [sys.executable, '-c', 'from dflash.train import train_cli; train_cli()', '--out', str(tmp_path / 'run'), '--max-steps', '1',
           '--targets', '1', '--no-final-eval', '--val-data', 'none', '--no-progress']
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and 'this machine has 1 GPU (GPU 0: NVIDIA H100 80GB HBM3' in r.stderr and 'DFLASH_DEVICE=cpu' in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / 'run' / 'checkpoints').exists()
    from dflash.recipe import TrainConfig, rank_device
    with pytest.raises(RuntimeError, match="device='cuda:0', but torch"): rank_device(TrainConfig(device='cuda:0'), 0)


def test_the_torch_floor_is_the_torch_tested(monkeypatch):
    """settings.ini declares the torch the suite runs with as the lowest it supports (it was 2.4; Muon needs 2.9, flex's mixed dtypes a
    recent one); set-up refuses an older torch."""
    from dflash.taps import torch_floor, environment
    assert torch_floor() == tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
    monkeypatch.setattr(torch, '__version__', '2.8.0')
    with pytest.raises(RuntimeError, match=r'torch 2.8.0 is older than 2.13'): environment()


def test_the_launcher_keeps_no_target(tmp_path, monkeypatch):
    """Where jobs run on a GPU, the launcher's own target work (extracting the validation split, calibrating targets='auto') runs in a child
    process: the ranks that share the GPU with it find it holding nothing. Forced here with DFLASH_LAUNCHER_CHILD=1: the launcher loads no
    target, and the extraction and the calibration are there. Before: both in the launcher, its cache never emptied."""
    import json
    from dflash import taps
    from dflash.recipe import TrainConfig
    from dflash.resolve import resolve
    from dflash.extracted import ExtractedDataset
    monkeypatch.setenv('DFLASH_LAUNCHER_CHILD', '1')
    before = taps.TARGET_LOADS[0]
    run = resolve(TrainConfig(out=str(tmp_path / 'run'), targets='auto', ranks=3, val_samples=4, max_samples=64, progress=False))
    assert taps.TARGET_LOADS[0] == before
    assert ExtractedDataset(run.config.val_extracted, require_complete=True).manifest['num_samples'] == 4
    cal = json.loads((tmp_path / 'run' / 'calibration.json').read_text())
    assert cal['target_tokens_per_s'] > 0 and cal['drafter_tokens_per_s'] > 0 and run.config.targets + run.config.drafters == 3


def test_a_script_without_a_main_guard(tmp_path):
    """A user's script with no `if __name__ == '__main__':` resolves a run whose launcher work runs in children (DFLASH_LAUNCHER_CHILD=1, as
    on a GPU): the children import dflash, not the script, which runs once. Before: each child ran the script again and died ('the process
    running extract died')."""
    import json, os
    script = tmp_path / 'my_run.py'
    script.write_text("from dflash.recipe import TrainConfig\nfrom dflash.resolve import resolve\nprint('the script starts', flush=True)\n"
                      f"run = resolve(TrainConfig(out={str(tmp_path / 'run')!r}, targets='auto', ranks=3, val_samples=4, max_samples=64, progress=False))\n"
                      "print('resolved', run.config.targets, run.config.drafters, flush=True)\n")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, 'DFLASH_LAUNCHER_CHILD': '1', 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count('the script starts') == 1 and 'resolved' in r.stdout, r.stdout[-2000:]
    assert json.loads((tmp_path / 'run' / 'calibration.json').read_text())['target_tokens_per_s'] > 0
