"A run trained on a fixed vocabulary publishes its served form beside the full one: a head of its own over that vocabulary, read by our loop."
import json
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
