"""`make docs` (tools/docs.py) as a writer meets it: a broken link between notebooks or a missing image is listed and the build
fails; the sidebar follows the data; an API page carries no memory address (two builds are the same bytes)."""
import importlib.util, json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('docs', ROOT / 'tools' / 'docs.py'); docs = importlib.util.module_from_spec(spec); spec.loader.exec_module(docs)


def notebook(path, *markdown):
    path.parent.mkdir(parents=True, exist_ok=True)
    cells = [dict(cell_type='markdown', id=f'c{i}', metadata={}, source=m) for i, m in enumerate(markdown)]
    path.write_text(json.dumps(dict(cells=cells, metadata={}, nbformat=4, nbformat_minor=5)))


def test_a_broken_link_or_a_missing_image_fails_the_build(tmp_path):
    nbs = tmp_path / 'nbs'
    notebook(nbs / 'index.ipynb', '# Home\n\nSee [the data](data.ipynb) and [gone](gone.ipynb).\n\n![ok](../assets/dashboard.png)\n\n![missing](../assets/none.png)')
    notebook(nbs / 'data.ipynb', '# Data')
    notebook(nbs / 'experiments' / 'x.ipynb', '# X\n\nBack to [the data](../data.ipynb).')
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(tmp_path / 'site'), '--nbs', str(nbs)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    assert 'error: index.ipynb: a link to gone.ipynb, no such notebook' in r.stderr and 'error: index.ipynb: an image assets/none.png, not in the site' in r.stderr, r.stderr
    assert '2 broken links or images' in r.stderr and 'dashboard.png' not in r.stderr and 'data.ipynb' not in r.stderr
    notebook(nbs / 'index.ipynb', '# Home\n\nSee [the data](data.ipynb).')
    assert docs.build(tmp_path / 'site2', nbs) == []


def test_the_sidebar_follows_the_data_and_api_pages_repeat():
    stems = [nb.stem for nb, rel, _, _ in docs.pages()]
    at = {s: i for i, s in enumerate(stems)}
    assert stems[0] == 'index' and at['data'] < at['batching'] < at['extract'] < at['train'] < at['model'] < at['evaluate']
    assert all(rel.parts[0] == 'experiments' for _, rel, _, _ in docs.pages()[len(docs.ORDER):]), 'experiments last'
    for nb, _, _, mod in docs.pages():
        if mod: assert ' at 0x' not in docs.api(mod), mod


def test_two_builds_are_the_same_bytes(tmp_path):
    "An API page (dist's: a default that is a function, whose repr carries an address) built twice in two processes: the same bytes."
    nbs = tmp_path / 'nbs'
    notebook(nbs / 'index.ipynb', '# Home')
    nb = json.loads((nbs / 'index.ipynb').read_text())
    nb['cells'].append(dict(cell_type='code', id='x', metadata={}, execution_count=None, outputs=[], source='#| default_exp dist'))
    (nbs / 'index.ipynb').write_text(json.dumps(nb))
    pages = []
    for k in (1, 2):
        out = tmp_path / f'site{k}'
        subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(out), '--nbs', str(nbs)], check=True, capture_output=True, timeout=300)
        pages.append((out / 'index.html').read_bytes())
    assert b'dflash.dist.Coord' in pages[0] and pages[0] == pages[1]
