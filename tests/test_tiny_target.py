"The committed embedded default: loads offline, and its held-out loss is the figure README reports."
import json, math, os, re, subprocess, sys
from pathlib import Path
import pytest, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from dflash.synth import DATA, SPLITS, make_corpus, split_path
from dflash.tiny_target import TARGET_DIR, encode_corpus, heldout_loss

ROOT = DATA.parent

@pytest.fixture(scope='module')
def target():
    os.environ['HF_HUB_OFFLINE'] = '1'
    return AutoTokenizer.from_pretrained(TARGET_DIR), AutoModelForCausalLM.from_pretrained(TARGET_DIR)

def test_loads_offline_as_qwen3_5_hybrid(target):
    tok, model = target
    assert model.config.model_type == 'qwen3_5_text'
    assert {'linear_attention', 'full_attention'} <= set(model.config.layer_types)
    assert 8 <= model.config.num_hidden_layers <= 12
    assert tok.mask_token == '<|mask|>' and tok.eos_token == '<|im_end|>' and tok.chat_template

@pytest.mark.slow
def test_heldout_loss_matches_readme(target):
    tok, model = target
    loss = heldout_loss(model, encode_corpus(tok, 'heldout'), tok.pad_token_id)
    log = json.loads((TARGET_DIR / 'train_log.json').read_text())[-1]
    assert abs(loss - log['heldout_loss']) < 2e-3, (loss, log)
    assert loss < math.log(len(tok)) / 4, 'the target should be far better than a uniform guess'
    readme = (ROOT / 'README.md').read_text()
    m = re.search(r'held-out loss ([0-9.]+) nats/token; uniform guess ([0-9.]+)', readme)
    assert m, 'README must report the held-out loss next to the uniform baseline'
    assert abs(float(m.group(1)) - loss) < 2e-3 and abs(float(m.group(2)) - math.log(len(tok))) < 1e-3

def test_greedy_generation_follows_the_template(target):
    tok, model = target
    prompt = tok.apply_chat_template([{'role': 'user', 'content': 'Convert 3 km to m.'}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id)
    text = tok.decode(out[0, len(prompt):])
    assert text.startswith('There are 1000 m in one km.'), text

def test_committed_splits_are_the_generator_output():
    for split, (n, seed) in SPLITS.items():
        lines = split_path(split).read_text().splitlines()
        assert [json.loads(l) for l in lines] == make_corpus(n, seed, split)

def test_generator_is_deterministic_across_processes():
    code = 'from dflash.synth import make_corpus; import json, hashlib; print(hashlib.sha256(json.dumps(make_corpus(300, 7)).encode()).hexdigest())'
    a, b = (subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ, 'PYTHONHASHSEED': s}).stdout for s in '12')
    assert a == b and len(a.strip()) == 64
