"""Peak resident memory of one drafter training step at the recipe's settings (5 layers, 512 anchors of 16 slots, sequences of
3072 tokens) on a stock-like target (8 layers, hidden 128), dense mask vs pieces of `attn_chunk` anchors, off the flex path.
Each setting runs in a fresh process: `python bench/attn_memory.py` prints one line each."""
import json, resource, subprocess, sys

def step(attn_chunk, seqs, S=3072, anchors=512):
    import torch, transformers as T
    from dflash.model import DFlashDraftModel, drafter_config
    torch.manual_seed(0); torch.set_num_threads(2)
    tc = T.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=2112, max_position_embeddings=4096)
    target = T.AutoModelForCausalLM.from_config(tc)
    d = DFlashDraftModel(drafter_config(tc, 5, 16, 2048)).attach_target(target)
    hs, ids = torch.randn(seqs, S, 5 * 128), torch.randint(0, 2048, (seqs, S))
    lm = torch.ones(seqs, S, dtype=torch.long)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    d(hs, ids, lm, num_anchors=anchors, attn_chunk=attn_chunk, generator=torch.Generator().manual_seed(0)).loss.backward()
    return dict(attn_chunk=attn_chunk, seqs=seqs, tokens=seqs * S, peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                before_step_gb=base / 2**20)

if __name__ == '__main__':
    if len(sys.argv) > 1: print(json.dumps(step(int(sys.argv[1]), int(sys.argv[2])))); sys.exit()
    for chunk, seqs in [(10**6, 1), (64, 1), (10**6, 5), (64, 5)]:
        r = subprocess.run([sys.executable, __file__, str(chunk), str(seqs)], capture_output=True, text=True)
        print(r.stdout.strip() or r.stderr[-500:], flush=True)
