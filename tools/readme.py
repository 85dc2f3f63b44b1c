"""Write README.md from nbs/index.ipynb (markdown cells as they are, code cells as python blocks
with their text outputs). `--check` fails when README.md is stale. nbdev 2.4's own nbdev_readme
needs Quarto, which these machines cannot install, so the conversion lives here."""
import json, sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent

def render(nb_path=root/'nbs'/'index.ipynb'):
    nb = json.loads(Path(nb_path).read_text())
    out = []
    for c in nb['cells']:
        src = ''.join(c['source']).rstrip()
        if not src or src.startswith('#| hide') or 'hide' in c.get('metadata', {}).get('tags', []): continue
        if c['cell_type'] == 'markdown': out.append(src)
        elif c['cell_type'] == 'code':
            lines = [l for l in src.splitlines() if not l.startswith('#|')]
            out.append('```python\n' + '\n'.join(lines) + '\n```')
            texts = [''.join(o.get('text', '') or o.get('data', {}).get('text/plain', '')) for o in c.get('outputs', [])]
            texts = [t.rstrip() for t in texts if t.strip()]
            if texts: out.append('```\n' + '\n'.join(texts) + '\n```')
    return '<!-- generated from nbs/index.ipynb by tools/readme.py; edit the notebook -->\n\n' + '\n\n'.join(out) + '\n'

if __name__ == '__main__':
    text, dest = render(), root/'README.md'
    if '--check' in sys.argv:
        if not dest.exists() or dest.read_text() != text: sys.exit('README.md is stale: run `make readme` (tools/readme.py) and commit')
    else: dest.write_text(text); print(f'wrote {dest}')
