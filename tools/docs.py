"""Build the documentation site from the notebooks into _docs/ (`make docs`): one HTML page per notebook (nbs/ and
nbs/experiments/), a sidebar listing every page, each module's API (the signature and docstring of every name it exports),
the links between notebooks and the images kept.

nbdev's own site (`nbdev_docs`) needs Quarto, and Quarto's PyPI package (`quarto-cli`) is a source distribution that
downloads its binary from GitHub when it installs; no wheel carries it, so it cannot install where only the package
registries are reachable. This builds the same pages offline with nbconvert, which jupyterlab already brings.

    python tools/docs.py [--out _docs]
"""
import argparse, html, importlib, inspect, json, re, shutil, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'

CSS = """body{margin:0;font:15px/1.5 system-ui,sans-serif;color:#222}nav{position:fixed;top:0;bottom:0;left:0;width:250px;overflow:auto;
background:#f6f6f4;border-right:1px solid #ddd;padding:12px;box-sizing:border-box;font-size:13px}nav h2{font-size:12px;text-transform:uppercase;
color:#777;margin:14px 0 4px}nav a{display:block;color:#235;text-decoration:none;padding:1px 0}nav a.here{font-weight:700}main{margin-left:270px;
max-width:980px;padding:8px 24px 60px}pre{background:#f4f4f4;padding:8px;overflow:auto;font-size:13px}code{font-size:90%}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 6px}.api{border-top:1px solid #ddd;padding-top:6px;margin-top:12px}.api h3{font-size:15px;margin:4px 0}
img{max-width:100%}"""

# After the page loads: every image decoded (a broken one has no width), told on <body> for a browser test to read.
CHECK = """<script>window.addEventListener('load',()=>{const i=[...document.images];document.body.dataset.images=i.length;
document.body.dataset.imagesOk=i.every(x=>x.complete&&x.naturalWidth>0)})</script>"""


def pages():
    "Every notebook as `(source, page path under the site, title, module or None)`: index first, then nbs/, then nbs/experiments/."
    out = []
    for nb in [NBS / 'index.ipynb'] + sorted(p for p in NBS.glob('*.ipynb') if p.name != 'index.ipynb') + sorted((NBS / 'experiments').glob('*.ipynb')):
        cells = json.loads(nb.read_text())['cells']
        first = next((''.join(c['source']) for c in cells if c['cell_type'] == 'markdown'), nb.stem)
        title = next((l[2:].strip() for l in first.splitlines() if l.startswith('# ')), nb.stem)
        mod = next((m.group(1) for c in cells if c['cell_type'] == 'code' and (m := re.search(r'^#\| default_exp (\S+)', ''.join(c['source']), re.M))), None)
        rel = Path('experiments') / f'{nb.stem}.html' if nb.parent.name == 'experiments' else Path(f'{nb.stem}.html')
        out.append((nb, rel, title, mod))
    return out


def api(mod):
    "The API section of module `dflash.<mod>`: every name of its `__all__` with its signature (a class: its constructor's) and docstring."
    m, items = importlib.import_module(f'dflash.{mod}'), []
    for name in getattr(m, '__all__', []):
        obj = getattr(m, name, None)
        if obj is None or not (inspect.isfunction(obj) or inspect.isclass(obj)): continue
        try: sig = str(inspect.signature(obj))
        except (TypeError, ValueError): sig = '(...)'
        doc = html.escape(inspect.getdoc(obj) or '')
        items.append(f'<div class="api" id="dflash.{mod}.{name}"><h3><code>dflash.{mod}.{html.escape(name + sig)}</code></h3>'
                     f'<p>{doc.replace(chr(10) + chr(10), "</p><p>")}</p></div>')
    return f'<h2 id="api">API: <code>dflash.{mod}</code></h2>' + ''.join(items) if items else ''


def body(nb, rel, known):
    "A notebook's cells as HTML (directives dropped, outputs kept), its links to other notebooks and its images pointed at the site's files."
    from nbconvert import HTMLExporter
    import nbformat
    node = nbformat.reads(nb.read_text(), as_version=4)
    for c in node.cells:
        if c.cell_type == 'code': c.source = '\n'.join(l for l in c.source.splitlines() if not l.startswith('#|')).strip()
    node.cells = [c for c in node.cells if c.source.strip()]
    exp = HTMLExporter(template_name='basic'); exp.exclude_input_prompt = exp.exclude_output_prompt = True
    text, _ = exp.from_notebook_node(node)
    up = '../' * (len(rel.parts) - 1)
    def link(name):
        "The page a notebook's name refers to, relative to this page (None: no such page)."
        target = known.get(name)
        return None if target is None else up + target.as_posix()
    text = re.sub(r'href="(?:\.\./)*(?:experiments/)?([\w-]+)\.ipynb"', lambda m: f'href="{link(m.group(1)) or "#"}"', text)
    text = re.sub(r'<code>(?:nbs/)?(?:experiments/)?([\w-]+)\.ipynb</code>',
                  lambda m: f'<a href="{link(m.group(1))}"><code>{m.group(1)}.ipynb</code></a>' if link(m.group(1)) else m.group(0), text)
    text = re.sub(r'src="(?:\.\./)*assets/', f'src="{up}assets/', text)
    return text


def build(out):
    out = Path(out)
    if out.exists(): shutil.rmtree(out)
    (out / 'experiments').mkdir(parents=True)
    shutil.copytree(ROOT / 'assets', out / 'assets')
    ps = pages()
    known = {nb.stem: rel for nb, rel, _, _ in ps}
    groups = [('Start', [p for p in ps if p[0].name == 'index.ipynb']), ('The package', [p for p in ps if p[3]]),
              ('Experiments', [p for p in ps if p[1].parts[0] == 'experiments'])]
    for nb, rel, title, mod in ps:
        up = '../' * (len(rel.parts) - 1)
        nav = ''.join(f'<h2>{g}</h2>' + ''.join(f'<a href="{up}{r.as_posix()}"{" class=here" if r == rel else ""}>{html.escape(t)}</a>' for _, r, t, _ in items)
                      for g, items in groups)
        page = (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)} - dflash</title><style>{CSS}</style></head>'
                f'<body><nav id="sidebar">{nav}</nav><main>{body(nb, rel, known)}{api(mod) if mod else ""}</main>{CHECK}</body></html>')
        (out / rel).write_text(page)
    print(f'{len(ps)} pages in {out}')
    return out


if __name__ == '__main__':
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0]); a.add_argument('--out', default=str(ROOT / '_docs'))
    build(a.parse_args().out)
