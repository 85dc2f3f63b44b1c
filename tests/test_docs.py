"""The documentation site (`make docs`, tools/docs.py) opened in headless Chromium, as a reader opens it: every page renders
with its title and the sidebar of every notebook, no internal link is broken, every image loads, and an API entry shows
its signature and docstring."""
import functools, html, http.server, re, shutil, subprocess, sys, threading
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow        # the second tier: `make test-all` (and CI) runs it, `make test` does not
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync', '--virtual-time-budget=3000']


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    "The site built into a temporary folder, served on localhost: `(folder, base url)`."
    out = tmp_path_factory.mktemp('docs') / '_docs'
    subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(out)], check=True, capture_output=True, timeout=600)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f'http://127.0.0.1:{server.server_port}'
    server.shutdown()


def dom(url, profile):
    "The page at `url` as headless Chromium renders it, after its scripts ran."
    r = subprocess.run([CHROMIUM, *FLAGS, f'--user-data-dir={profile}', '--dump-dom', url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and '<body' in r.stdout, r.stderr[-2000:]
    return r.stdout


def test_every_page_renders_with_its_sidebar_links_and_images(site, tmp_path):
    if CHROMIUM is None: pytest.fail('headless Chromium is not installed: `make browser` installs Debian\'s chromium')
    out, base = site
    pages = sorted(p.relative_to(out).as_posix() for p in out.rglob('*.html'))
    notebooks = sorted([p.stem for p in (ROOT / 'nbs').glob('*.ipynb')] + [f'experiments/{p.stem}' for p in (ROOT / 'nbs' / 'experiments').glob('*.ipynb')])
    assert sorted(p[:-5] for p in pages) == notebooks                               # a page for every notebook, and no other
    for page in pages:
        d = dom(f'{base}/{page}', tmp_path / 'chromium')
        title = html.unescape(re.search(r'<title>(.*?) - dflash</title>', d).group(1))
        h1 = html.unescape(re.sub(r'<[^>]+>|¶', '', re.search(r'<h1.*?</h1>', d, re.S).group(0))).strip()
        assert title and h1 == title, (page, title, h1)                             # the page's title, rendered
        side = re.search(r'<nav id="sidebar">(.*?)</nav>', d, re.S).group(1)
        assert len(re.findall(r'<a href=', side)) == len(pages), page                # the sidebar lists every notebook
        assert 'data-images-ok="true"' in d, (page, re.search(r'data-images[^>]*', d).group(0))   # every image decoded
        for href in re.findall(r'href="([^"#]+\.html)"', d):                         # no internal link broken
            assert (out / Path(page).parent / href).resolve().is_file(), (page, href)


def test_an_api_entry_shows_its_signature_and_docstring(site, tmp_path):
    if CHROMIUM is None: pytest.fail('headless Chromium is not installed: `make browser` installs Debian\'s chromium')
    out, base = site
    d = dom(f'{base}/tree.html', tmp_path / 'chromium')
    entry = re.search(r'<div class="api" id="dflash.tree.build_tree">(.*?)</div>', d, re.S).group(1)
    assert '<code>dflash.tree.build_tree(logits, budget)</code>' in entry and "DDTree's tree from a drafter's per-slot" in entry.replace('&#x27;', "'")
