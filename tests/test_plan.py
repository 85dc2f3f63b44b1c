"Planning a run from config.json alone: exact parameter counts, memory, disk, FLOPs and a split, from Python and the shell."
import subprocess, sys
from pathlib import Path
from dflash.core import DATA
from dflash.plan import plan, target_flops_per_token

QWEN3_8B, HYBRID = DATA / 'configs' / 'qwen3-8b', DATA / 'configs' / 'qwen3.6-27b-hybrid'


def test_qwen3_8b_counts_and_disk():
    p = plan(target=str(QWEN3_8B), gpus=8, gpu_mem_gb=80, dataset_tokens=1e9)
    assert round(p['params'] / 1e9, 2) == 8.19 and p['layer_ids'] == [1, 9, 17, 25, 33]     # as published
    assert p['weights_gb'] == 2 * p['params'] / 1e9 and p['fits'] and p['token_budget'] > 100_000
    assert p['disk_bytes_per_token'] == {'fp32': 5 * 4096 * 4 + 5, 'bf16': 5 * 4096 * 2 + 5, 'fp8': 5 * 4096 + 9}
    assert p['targets'] + p['drafters'] == 8 and min(p['targets'], p['drafters']) >= 1


def test_a_27b_hybrid_needs_an_80gb_gpu():
    big, small = plan(target=str(HYBRID), gpu_mem_gb=80), plan(target=str(HYBRID), gpu_mem_gb=48)
    assert 26 < big['params'] / 1e9 < 28 and big['layer_ids'] == [1, 16, 31, 46, 61]
    assert big['fits'] and not small['fits'] and small['token_budget'] == 0


def test_attention_cost_grows_with_length_only_in_full_attention_layers():
    from dflash.taps import load_target_config
    c = load_target_config(HYBRID)
    extra = target_flops_per_token(c, [61], 8000) - target_flops_per_token(c, [61], 2000)
    assert extra == 15 * 4 * 24 * 256 * (8000 - 2000) / 2     # full attention in layers 3, 7, ..., 59 (15 of them) up to layer 61


def test_cli(tmp_path):
    r = subprocess.run([str(Path(sys.executable).parent / 'dflash_plan'), '--target', str(QWEN3_8B), '--gpus', '4', '--gpu-mem-gb', '24'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'a starting split of 4 GPUs' in r.stdout and '8.19B parameters' in r.stdout
