"A run trained on a fixed vocabulary publishes its served form beside the full one: a head of its own over that vocabulary, read by our loop."
import json
import pytest, torch
from dflash.core import TINY_TARGET, REGEN_DATA, HELDOUT_REGEN
from dflash.extract import extract
from dflash.train import train
from dflash.designs import drafter_class


def test_a_run_with_a_training_vocabulary_publishes_its_served_form(tmp_path):
    x = extract(target=str(TINY_TARGET), data=str(REGEN_DATA), out=str(tmp_path / 'x'), layer_ids=[2], max_samples=48, token_budget=1024, progress=False)
    v = extract(target=str(TINY_TARGET), data=str(HELDOUT_REGEN), out=str(tmp_path / 'v'), layer_ids=[2], max_samples=8, token_budget=1024, progress=False)
    r = train(target=str(TINY_TARGET), extracted=x['out'], val_extracted=v['out'], out=str(tmp_path / 'run'), train_vocab=64, max_steps=4,
              eval_prompts=2, eval_max_new_tokens=16, num_layers=1, progress=False, engine_eval=False, val_tree_budgets='none', log_every=2)
    served, full = tmp_path / 'run' / 'drafter-vocab', tmp_path / 'run' / 'drafter'
    assert r['drafter_vocab'] == str(served) and r['draft_vocab_size'] == 64 and 0 < r['vocab_coverage_heldout'] < 1 and r['tau_vocab'] >= 1
    assert drafter_class(served).__name__ == 'DFlashVocabDraftModel' and json.loads((served / 'config.json').read_text())['draft_vocab_size'] == 64
    assert 'draft_vocab_size' not in json.loads((full / 'config.json').read_text()) and drafter_class(full).__name__ == 'DFlashDraftModel'
    card = (served / 'README.md').read_text()
    assert 'a head over the 64 most frequent labels' in card and f"{r['vocab_coverage_heldout']:.2%} of the held-out ones" in card
    assert 'served with a vocabulary of its own' in (full / 'README.md').read_text()


@pytest.mark.slow
def test_llamacpp_serves_a_bf16_served_vocabulary_on_smollm2_losslessly(tmp_path):
    "SmolLM2-135M-Instruct and a drafter for it published as a real run publishes it (bf16) with a head over every third token: the map exact, llama.cpp lossless."
    from safetensors import safe_open
    from dflash.gguf import smollm2
    from dflash.taps import load_target, load_tokenizer
    from dflash.model import DFlashDraftModel, drafter_config
    from dflash.draft_vocab import DFlashVocabDraftModel
    from dflash.publish import save_drafter
    from dflash.engine import engine_check
    t = smollm2(); target, tok = load_target(t, dtype=torch.float32), load_tokenizer(t)
    torch.manual_seed(0)
    full = DFlashDraftModel(drafter_config(target.config, 1, 4, 16, [1, 8])).attach_target(target)
    ids = torch.arange(0, target.config.vocab_size, 3)
    p = save_drafter(DFlashVocabDraftModel.from_full(full, ids), tmp_path / 'served', torch.bfloat16)
    with safe_open(p / 'model.safetensors', 'pt') as s: assert torch.equal(torch.arange(len(ids)) + s.get_tensor('d2t'), ids)
    prompts = [tok.apply_chat_template([dict(role='user', content=q)], tokenize=True, add_generation_prompt=True, return_dict=False) for q in ('Name three colours.', 'What is 2 + 2?')]
    r = engine_check(t, p, prompts, max_new_tokens=16, threads=2)
    assert r['lossless'] and r['drafts'] > 0, r
