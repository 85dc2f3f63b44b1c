"""Cost of sliding-window layers in one drafter training step off the flex path, side by side in one process: the recipe's
5 layers, 512 anchors, one sequence of 3072 tokens on a stock-like target (hidden 128), all full vs 4 sliding + 1 full
(window 2048, and window 256). Alternating repetitions; prints the median seconds of each and the ratio to all-full.

    python bench/window_step.py [--reps 3]
"""
import argparse, json, statistics, time
import torch, transformers as T
from dflash.model import DFlashDraftModel, drafter_config

def main(a):
    torch.manual_seed(0); torch.set_num_threads(a.threads)
    tc = T.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=2112, max_position_embeddings=4096)
    target = T.AutoModelForCausalLM.from_config(tc)
    sw = ['sliding_attention'] * 4 + ['full_attention']
    layouts = {'full': (None, None), 'sliding W=2048': (sw, 2048), 'sliding W=256': (sw, 256)}
    models = {k: DFlashDraftModel(drafter_config(tc, 5, 16, 2048, layer_types=t, sliding_window=w)).attach_target(target) for k, (t, w) in layouts.items()}
    S = 3072
    hs, ids, lm = torch.randn(1, S, 5 * 128), torch.randint(0, 2048, (1, S)), torch.ones(1, S, dtype=torch.long)
    times = {k: [] for k in models}
    for r in range(a.reps + 1):
        for k, m in models.items():
            t0 = time.perf_counter()
            m(hs, ids, lm, num_anchors=512, generator=torch.Generator().manual_seed(r)).loss.backward()
            if r: times[k].append(time.perf_counter() - t0)      # the first round warms up
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({k: dict(step_s=round(v, 3), vs_full=round(v / med['full'], 2)) for k, v in med.items()}))

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--reps', type=int, default=3); ap.add_argument('--threads', type=int, default=1)
    main(ap.parse_args())
