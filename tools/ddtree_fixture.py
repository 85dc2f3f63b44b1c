"""Record DDTree's own trees on fixed inputs, for tests/test_tree.py to hold dflash.tree.build_tree to.

    git --git-dir=DIR show HEAD:ddtree.py > /tmp/ddtree.py            DIR: a clone of github.com/liranringel/ddtree (MIT)
    .venv/bin/python tools/ddtree_fixture.py /tmp/ddtree.py --commit $(git --git-dir=DIR rev-parse HEAD)

Imports the given copy of the reference's ddtree.py with its heavy or unrelated imports stubbed (loguru, transformers, and
the repository's own `model` and `dflash` modules, whose `dflash` would clash with ours), and calls its real
`build_ddtree_tree` on each case below. Writes tests/fixtures/ddtree_trees.json: per case its logits (float32 values,
exact in JSON), budget, and the reference's node tokens, depths, parents and visibility rows; plus the reference commit,
the copy's sha256 and the torch version (torch.topk orders equal logits its own way; the tie cases depend on it).
"""
import argparse, contextlib, hashlib, importlib.util, json, math, sys, time, types
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'tests' / 'fixtures' / 'ddtree_trees.json'


@contextlib.contextmanager
def _stubs():
    "Stand-ins for the modules ddtree.py imports but build_ddtree_tree does not use; sys.modules is restored afterwards."
    def mod(name, **attrs):
        m = types.ModuleType(name); m.__dict__.update(attrs); return m
    class _Log:
        def __getattr__(self, name): return lambda *a, **k: None
    stubs = {'loguru': mod('loguru', logger=_Log()),
             'transformers': mod('transformers', AutoModelForCausalLM=object, DynamicCache=object),
             'model': mod('model', DFlashDraftModel=object, sample=None, extract_context_feature=None),
             'dflash': mod('dflash', dflash_generate=None, cuda_time=time.perf_counter,     # the reference's synchronizes CUDA first
                           empty_stage_times=lambda names: {n: 0.0 for n in names})}
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try: yield
    finally:
        for k, v in saved.items():
            if v is None: sys.modules.pop(k, None)
            else: sys.modules[k] = v


def load_reference(path):
    "The reference's ddtree.py at `path`, imported as module `ddtree_reference` with its unused imports stubbed."
    spec = importlib.util.spec_from_file_location('ddtree_reference', path)
    m = importlib.util.module_from_spec(spec)
    with _stubs(): spec.loader.exec_module(m)
    return m


def reference_tree(ref, logits, budget):
    "The reference's tree as plain lists: node tokens, depths, parents ([-1, ...], root first) and visibility rows (True columns)."
    tokens, depths, parents, _, vis, _ = ref.build_ddtree_tree(logits, budget)
    return dict(tokens=tokens.tolist(), depths=depths.tolist(), parents=[int(p) for p in parents],
                visible=[torch.nonzero(r).flatten().tolist() for r in vis])


def cases():
    "(name, logits [L, V] float32, budget): random, edge and tie cases, seeded."
    g = lambda s: torch.Generator().manual_seed(s)
    rnd = lambda s, L, V, scale=1.0: (torch.randn(L, V, generator=g(s)) * scale).float()
    row = torch.tensor([2.0, 1.0, 0.5, -1.0])
    masked = rnd(7, 2, 5); masked[:, 2:] = -math.inf
    return [
        ('budget_1', rnd(1, 3, 5), 1),
        ('small', rnd(2, 4, 8), 10),
        ('block16_budget64', rnd(3, 15, 50, 2.0), 64),
        ('block16_budget128_peaked', rnd(4, 15, 200, 4.0), 128),
        ('deep_chain', rnd(5, 8, 30, 10.0), 40),
        ('budget_over_LV', rnd(6, 2, 3), 7),                       # 7 > L*V = 6, fewer than the 3 + 9 possible nodes
        ('budget_over_all_paths', rnd(6, 2, 3), 20),               # only 12 paths exist: the heap empties first
        ('one_slot', rnd(8, 1, 4), 10),
        ('budget_0', rnd(9, 3, 5), 0),
        ('no_slots', torch.zeros(0, 5), 5),
        ('one_token_vocab', rnd(10, 4, 1), 6),
        ('path_ties', row.repeat(3, 1), 20),                       # distinct logits in a slot, many paths of equal probability
        ('uniform', torch.zeros(3, 4), 30),                        # every path of a depth ties, and so do the tokens of a slot
        ('token_ties', torch.tensor([1.0, 1, 1, 0, 0, -1]).repeat(3, 1), 30),
        ('neg_inf_logits', masked, 12),                            # only 6 paths of nonzero probability: then -inf ones, NaN keys
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('ddtree', help="a copy of the reference's ddtree.py")
    p.add_argument('--commit', default='unknown', help='the reference commit the copy is from (git rev-parse HEAD)')
    p.add_argument('--out', default=str(OUT))
    a = p.parse_args(argv)
    ref = load_reference(a.ddtree)
    out = dict(reference='https://github.com/liranringel/ddtree ddtree.py build_ddtree_tree (MIT)', commit=a.commit,
               sha256=hashlib.sha256(Path(a.ddtree).read_bytes()).hexdigest(), torch=torch.__version__,
               cases=[dict(name=n, shape=list(x.shape), budget=b, logits=x.tolist(), tree=reference_tree(ref, x, b))
                      for n, x, b in cases()])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out) + '\n')
    for c in out['cases']: print(f"{c['name']:28s} L,V={c['shape']} budget={c['budget']}: {len(c['tree']['tokens'])} nodes")
    print(f'wrote {a.out}')


if __name__ == '__main__': main()
