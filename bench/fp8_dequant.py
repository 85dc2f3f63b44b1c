"""Host work of an fp8 micro-batch, before and after the dequantization moved to the device (issue 58), as a share of the drafter's
step: the old path dequantized every sample on a host core (`dequantize_fp8` to float32); the new one only gathers the stored fp8
rows and their scales (`torch.cat`) and dequantizes where the batch lands. Timed on a slice on this CPU with one thread (a prefetch
thread's core), extrapolated to one micro-batch at the run's planned token budget (`dflash_plan`, 4 x 80 GB) of Qwen3-8B and of the
Qwen3.6-27B hybrid; the drafter's step from the plan's FLOPs per token on an H100 (989 TFLOP/s bf16) at a stated MFU.

    python bench/fp8_dequant.py [--mfu 0.35] [--rows 1024]
"""
import argparse, time


def per_element(fn, n=5):
    "Seconds per call of `fn`, the best of `n`."
    best = float('inf')
    for _ in range(n):
        t0 = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t0)
    return best


def main(a):
    import torch
    from dflash.core import DATA
    from dflash.plan import plan
    from dflash.shards import quantize_fp8, dequantize_fp8
    from dflash.taps import load_target_config, text_config
    torch.set_num_threads(1)
    print(f'| target | token budget | values a micro-batch | old: host dequantize, s | new: host gather, s | drafter step on an H100 at '
          f'MFU {a.mfu:g}, s | old share | new share |\n|---|---:|---:|---:|---:|---:|---:|---:|')
    for name, cfg in (('Qwen3-8B', 'qwen3-8b'), ('Qwen3.6-27B hybrid', 'qwen3.6-27b-hybrid')):
        p = plan(target=str(DATA / 'configs' / cfg), gpus=4, gpu_mem_gb=80)
        F = len(p['layer_ids']) * text_config(load_target_config(DATA / 'configs' / cfg)).hidden_size        # taps x H values a token
        x = torch.randn(a.rows, F, dtype=torch.bfloat16)
        q, s = quantize_fp8(x)
        rows = [(q[i:i + 64], s[i:i + 64]) for i in range(0, a.rows, 64)]             # samples as the dataset reads them
        old = per_element(lambda: [dequantize_fp8(r, c, torch.float32) for r, c in rows]) / (a.rows * F)
        new = per_element(lambda: (torch.cat([r for r, _ in rows]), torch.cat([c for _, c in rows]))) / (a.rows * F)
        tokens = p['run_token_budget']
        step = p['drafter_gflop_per_token'] * 1e9 * tokens / (989e12 * a.mfu)
        n = tokens * F
        print(f"| {name} | {tokens:,} | {n / 1e6:,.0f}M | {n * old:.2f} | {n * new:.3f} | {step:.2f} | {n * old / step:.0%} | "
              f"{n * new / step:.1%} |")


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--mfu', type=float, default=0.35, help="the drafter step's model FLOPs utilization on the H100 (a stated guess)")
    p.add_argument('--rows', type=int, default=1024, help='token rows of the timed slice')
    main(p.parse_args())
