"""Make tests/fixtures/resume-v1: a training run of today's layout, for `tests/test_resume_fixture.py` to resume with the code of
any later day. A random 2-layer Qwen3 target (hidden 32, the embedded tokenizer) saved with it, 16 conversations of the embedded
train split, an offline run of 2 steps checkpointed at step 2. Run once, from the repository root: `python tools/resume_fixture.py`.
"""
import json, shutil, subprocess, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'tests' / 'fixtures' / 'resume-v1'
BIN = Path(sys.executable).parent


def main():
    from dflash.core import TINY_TARGET, TRAIN_DATA
    if OUT.exists(): shutil.rmtree(OUT)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(OUT / 'target'); tok.save_pretrained(OUT / 'target')
    (OUT / 'rows.jsonl').write_text(''.join(open(TRAIN_DATA).readlines()[:16]))
    tmp = OUT.parent / '.resume-v1-x'
    run = lambda *a: subprocess.run([str(x) for x in a], check=True, capture_output=True, text=True)
    run(BIN / 'dflash_extract', '--target', OUT / 'target', '--data', OUT / 'rows.jsonl', '--out', tmp, '--layer-ids', '0', '--no-progress')
    run(BIN / 'dflash_train', '--target', OUT / 'target', '--extracted', tmp, '--out', OUT / 'run', *ARGS, '--max-steps', 2)
    shutil.rmtree(tmp)
    for f in ('drafter', 'result.json', 'logs'): shutil.rmtree(OUT / 'run' / f, ignore_errors=True) if (OUT / 'run' / f).is_dir() else (OUT / 'run' / f).unlink(missing_ok=True)
    print(sorted(str(p.relative_to(OUT)) for p in OUT.rglob('*') if p.is_file()))


ARGS = ['--num-layers', 1, '--num-anchors', 8, '--token-budget', 256, '--lr', 3e-3, '--log-every', 1, '--no-final-eval', '--no-progress',
        '--warmup', 0, '--val-data', 'none', '--no-servable', '--ckpt-every', 2, '--optimizer', 'muon', '--loss', 'dpace', '--block-size', 4]

if __name__ == '__main__': main()
