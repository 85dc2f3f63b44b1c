"The package's shape: modules import only those below them in the data flow, and the drafter loads without the jobs."
import ast, subprocess, sys
from pathlib import Path
import dflash

PKG = Path(dflash.__file__).parent
# lowest first: a module may import only modules before it (synth and tiny_target only make the embedded default; gguf makes the
# real one, which the engine check serves by default)
ORDER = ['core', 'gguf', 'track', 'taps', 'data', 'server', 'regenerate', 'batching', 'store', 'shards', 'extracted', 'mirror', 'feed', 'metrics', 'extract', 'blocks', 'draft_cache', 'loss', 'model', 'draft_vocab', 'dflash2', 'dspark', 'xpress', 'designs', 'tree', 'speedup', 'publish', 'inputs', 'validate',
         'cache', 'sampling', 'verify', 'evaluate', 'treecal', 'llamacpp', 'convert', 'engine', 'peers', 'dist', 'recipe', 'optim', 'balance', 'checkpoint', 'release', 'plan', 'resolve', 'trainer', 'train']
SIDE = {'synth': [], 'tiny_target': ['synth']}


def imports(mod):
    tree = ast.parse((PKG / f'{mod}.py').read_text())
    return {n.module.lstrip('.').removeprefix('dflash.') for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and (n.level == 1 or n.module.startswith('dflash.'))}


def test_every_module_is_placed():
    mods = {p.stem for p in PKG.glob('*.py')} - {'__init__', '_modidx'}
    assert mods == set(ORDER) | set(SIDE)


def test_imports_run_one_way():
    for i, mod in enumerate(ORDER):
        assert imports(mod) <= set(ORDER[:i]), f'{mod} imports {imports(mod) - set(ORDER[:i])}, which are not below it'
    for mod, allowed in SIDE.items(): assert imports(mod) <= set(allowed)


def test_the_drafter_loads_without_jobs_or_plotting():
    code = ("import sys, dflash.model; print(' '.join(m for m in ('matplotlib.pyplot', 'dflash.extract', 'dflash.data', 'dflash.synth', "
            "'dflash.train', 'dflash.tiny_target', 'tokenizers.trainers') if m in sys.modules))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == '', r.stdout + r.stderr[-2000:]


def test_every_torch_cuda_call_exists():
    "Code that runs only on a GPU still names real functions: every `torch.cuda.X` in the package exists in this torch."
    import torch
    for p in PKG.glob('*.py'):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == 'cuda' \
                    and isinstance(n.value.value, ast.Name) and n.value.value.id == 'torch':
                assert hasattr(torch.cuda, n.attr), f'{p.name}:{n.lineno}: torch.cuda.{n.attr} does not exist'
