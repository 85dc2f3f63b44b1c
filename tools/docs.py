"""Build the documentation site from the notebooks into _docs/ (`make docs`): one HTML page per notebook (nbs/ and
nbs/experiments/), a sidebar listing every page, each module's API (the signature and docstring of every name it exports),
the links between notebooks and the images kept.

nbdev's own site (`nbdev_docs`) needs Quarto, and Quarto's PyPI package (`quarto-cli`) is a source distribution that
downloads its binary from GitHub when it installs; no wheel carries it, so it cannot install where only the package
registries are reachable. This builds the same pages offline with nbconvert, which jupyterlab already brings.

    python tools/docs.py [--out _docs]

A link to a notebook that is not there, or an image that is not in the site, is listed and the build exits non-zero. The
sidebar follows the data (data -> batching -> extract -> train -> model -> evaluate, then the experiments); two builds of the
same notebooks are the same bytes.
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
img{max-width:100%}pre{white-space:pre-wrap;overflow-wrap:anywhere}"""

# After the page loads: every image decoded (a broken one has no width), told on <body> for a browser test to read.
CHECK = """<script>window.addEventListener('load',()=>{const i=[...document.images];document.body.dataset.images=i.length;
document.body.dataset.imagesOk=i.every(x=>x.complete&&x.naturalWidth>0)})</script>"""


# The package's notebooks in the order the data flows through them (a notebook not named here comes after, by name).
ORDER = ('index', 'core', 'tiny_target', 'data', 'synth', 'server', 'regenerate', 'batching', 'taps', 'extract', 'shards', 'store',
         'mirror', 'extracted', 'feed', 'gguf', 'recipe', 'resolve', 'plan', 'dist', 'balance', 'train', 'trainer', 'optim',
         'checkpoint', 'track', 'metrics', 'blocks', 'loss', 'model', 'draft_cache', 'dflash2', 'dspark', 'xpress', 'designs',
         'draft_vocab', 'validate', 'cache', 'verify', 'sampling', 'tree', 'inputs', 'evaluate', 'treecal', 'speedup', 'llamacpp',
         'convert', 'engine', 'publish', 'release', 'peers')


def pages(nbs=NBS):
    "Every notebook as `(source, page path under the site, title, module or None)`: nbs/ in `ORDER`, then nbs/experiments/ by name."
    out, rank = [], {n: i for i, n in enumerate(ORDER)}
    for nb in sorted(nbs.glob('*.ipynb'), key=lambda p: (rank.get(p.stem, len(rank)), p.stem)) + sorted((nbs / 'experiments').glob('*.ipynb')):
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
        try: sig = re.sub(r' at 0x[0-9a-f]+', '', str(inspect.signature(obj)))     # a default's repr without its address: builds repeat
        except (TypeError, ValueError): sig = '(...)'
        doc = html.escape(inspect.getdoc(obj) or '')
        items.append(f'<div class="api" id="dflash.{mod}.{name}"><h3><code>dflash.{mod}.{html.escape(name + sig)}</code></h3>'
                     f'<p>{doc.replace(chr(10) + chr(10), "</p><p>")}</p></div>')
    return f'<h2 id="api">API: <code>dflash.{mod}</code></h2>' + ''.join(items) if items else ''


def body(nb, rel, known, problems=None):
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
    def linked(m):
        if (to := link(m.group(1))) is None and problems is not None: problems.append(f'{nb.name}: a link to {m.group(1)}.ipynb, no such notebook')
        return f'href="{to or "#"}"'
    text = re.sub(r'href="(?:\.\./)*(?:experiments/)?([\w-]+)\.ipynb"', linked, text)
    text = re.sub(r'<code>(?:nbs/)?(?:experiments/)?([\w-]+)\.ipynb</code>',
                  lambda m: f'<a href="{link(m.group(1))}"><code>{m.group(1)}.ipynb</code></a>' if link(m.group(1)) else m.group(0), text)
    text = re.sub(r'src="(?:\.\./)*assets/', f'src="{up}assets/', text)
    return text


def images(page, out):
    "The images a built page shows that are not in the site: `src` paths (not data: or http) with no file behind them."
    from urllib.parse import unquote
    local = lambda src: unquote(html.unescape(src).split('#')[0].split('?')[0])
    return [src for src in re.findall(r'<img[^>]*?src="([^"]+)"', page.read_text())
            if not src.startswith(('data:', 'http:', 'https:', '//')) and not (page.parent / local(src)).resolve().is_file()]


def build(out, nbs=NBS):
    "The site in `out`; returns the problems found (broken links between notebooks, missing images), each naming its notebook."
    out = Path(out)
    if out.exists(): shutil.rmtree(out)
    (out / 'experiments').mkdir(parents=True)
    shutil.copytree(ROOT / 'assets', out / 'assets')
    ps, problems = pages(nbs), []
    known = {nb.stem: rel for nb, rel, _, _ in ps}
    groups = [('Start', [p for p in ps if p[0].name == 'index.ipynb']), ('The package', [p for p in ps if p[3]]),
              ('Experiments', [p for p in ps if p[1].parts[0] == 'experiments'])]
    for nb, rel, title, mod in ps:
        up = '../' * (len(rel.parts) - 1)
        nav = ''.join(f'<h2>{g}</h2>' + ''.join(f'<a href="{up}{r.as_posix()}"{" class=here" if r == rel else ""}>{html.escape(t)}</a>' for _, r, t, _ in items)
                      for g, items in groups)
        page = (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)} - dflash</title><style>{CSS}</style></head>'
                f'<body><nav id="sidebar">{nav}</nav><main>{body(nb, rel, known, problems)}{api(mod) if mod else ""}</main>{CHECK}</body></html>')
        (out / rel).write_text(page)
        problems += [f'{nb.name}: an image {src}, not in the site' for src in images(out / rel, out)]
    print(f'{len(ps)} pages in {out}')
    for p in problems: print(f'error: {p}', file=sys.stderr)
    return problems


if __name__ == '__main__':
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0]); a.add_argument('--out', default=str(ROOT / '_docs')); a.add_argument('--nbs', default=str(NBS))
    args = a.parse_args()
    if problems := build(args.out, Path(args.nbs)): sys.exit(f'{len(problems)} broken links or images (listed above)')
