"""Run notebooks and keep the outputs of the cells that draw a picture (and only those), so that the pictures show
when a notebook is opened on a code host. Cells flagged `slow` or `gpu` are skipped, as nbdev_test skips them.

    .venv/bin/python tools/figures.py nbs/model.ipynb nbs/metrics.ipynb      (then nbdev_clean, and commit)
"""
import os, sys
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

SKIP = ('#| slow', '#| gpu', '#|slow', '#|gpu')


def figures(path):
    "Run the notebook at `path` in its own folder; keep image outputs, drop every other output. Returns the number kept."
    path = Path(path).resolve()
    nb = read_nb(path)
    cwd = os.getcwd(); os.chdir(path.parent)
    try:
        shell = CaptureShell()
        shell.run_all(nb, exc_stop=True, preproc=lambda c: c.cell_type != 'code' or c.source.lstrip().startswith(SKIP))
    finally: os.chdir(cwd)
    kept = 0
    for c in nb.cells:
        if c.cell_type != 'code': continue
        pics = [o for o in c.get('outputs', []) if 'image/png' in o.get('data', {})]
        c['outputs'] = [dict(o, data={k: v for k, v in o['data'].items() if k in ('image/png', 'text/plain')}) for o in pics]
        c['execution_count'] = None
        kept += len(pics)
    write_nb(nb, path)
    return kept


if __name__ == '__main__':
    for p in sys.argv[1:]: print(f'{p}: {figures(p)} pictures kept')
