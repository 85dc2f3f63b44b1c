"""flex_attention on the CPU against the chunked SDPA path, at the recipe's settings (5 layers, 512 anchors, one sequence of 3072
tokens, stock-like target of hidden 128): forward time of each, then whether flex has a backward here.

    python bench/flex_cpu.py
"""
import time, torch, transformers as T
from dflash.model import DFlashDraftModel, drafter_config
torch.manual_seed(0); torch.set_num_threads(2)
tc = T.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, vocab_size=2112, max_position_embeddings=4096)
target = T.AutoModelForCausalLM.from_config(tc)
d = DFlashDraftModel(drafter_config(tc, 5, 16, 2048)).attach_target(target)
S = 3072
hs, ids, lm = torch.randn(1, S, 5 * 128), torch.randint(0, 2048, (1, S)), torch.ones(1, S, dtype=torch.long)
for impl in ['sdpa', 'flex', 'sdpa', 'flex']:
    t0 = time.perf_counter()
    with torch.no_grad(): o = d(hs, ids, lm, num_anchors=512, attn_impl=impl, generator=torch.Generator().manual_seed(0))
    print(impl, 'forward', round(time.perf_counter() - t0, 2), 's', round(o.loss.item(), 5), flush=True)
try:
    t0 = time.perf_counter()
    d(hs, ids, lm, num_anchors=512, attn_impl='flex', generator=torch.Generator().manual_seed(0)).loss.backward()
    print('flex backward ok', round(time.perf_counter() - t0, 2))
except Exception as e: print('flex backward:', type(e).__name__, str(e)[:300])
