"Tests of dflash.tree: build_tree gives DDTree's own trees (liranringel/ddtree, build_ddtree_tree), recorded and, given a copy, live."
import importlib.util, json, math, os, random
from pathlib import Path
import pytest, torch
from dflash.tree import build_tree, tree_inputs

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / 'tests' / 'fixtures' / 'ddtree_trees.json').read_text())


def ours(logits, budget):
    "Our tree in the reference's terms: node tokens, depths, parents ([-1, ...], root first), visibility rows."
    t = build_tree(logits, budget)
    _, _, mask = tree_inputs(t, 0, 0)
    return dict(tokens=t.tokens, depths=t.depths, parents=[-1] + t.parents, visible=[torch.nonzero(r).flatten().tolist() for r in mask])


@pytest.mark.parametrize('case', FIXTURE['cases'], ids=lambda c: c['name'])
def test_build_tree_equals_the_recorded_reference_trees(case):
    logits = torch.tensor(case['logits'], dtype=torch.float32).reshape(case['shape'])
    assert ours(logits, case['budget']) == case['tree'], \
        f"reference commit {FIXTURE['commit']}, recorded with torch {FIXTURE['torch']} (this is {torch.__version__}: the tie cases follow torch.topk)"


def fresh_cases(n=40, seed=0):
    "Random inputs of every kind: shapes, budgets (over L*V included), scales, rounded logits (ties), bf16, -inf tokens."
    r = random.Random(seed)
    for s in range(n):
        L, V, budget = r.randint(1, 16), r.randint(1, 200), r.choice([1, 2, r.randint(1, 40), r.randint(1, 300)])
        x = torch.randn(L, V, generator=torch.Generator().manual_seed(s)) * r.choice([0.5, 1.0, 3.0, 10.0])
        if s % 4 == 1: x = x.round()
        if s % 5 == 2: x = x.to(torch.bfloat16)
        if s % 6 == 3 and V > 2: x[:, r.randint(1, V - 1):] = -math.inf
        yield x, budget


def test_build_tree_equals_the_reference_on_fresh_inputs():
    path = os.environ.get('DDTREE_REF')
    if not path:
        pytest.skip('no copy of the reference ddtree.py given: set DDTREE_REF to one (see tools/ddtree_fixture.py)')
    spec = importlib.util.spec_from_file_location('ddtree_fixture', ROOT / 'tools' / 'ddtree_fixture.py')
    fx = importlib.util.module_from_spec(spec); spec.loader.exec_module(fx)
    ref = fx.load_reference(path)
    for i, (x, budget) in enumerate(fresh_cases()):
        assert ours(x, budget) == fx.reference_tree(ref, x, budget), f'case {i}: L, V = {tuple(x.shape)}, budget {budget}, {x.dtype}'
