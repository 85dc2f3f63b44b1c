"""Hidden states in an object store (issue 50), against a real S3 server: moto's standalone server in a process of its own, spoken
to over HTTP by s3fs (the client dflash uses), through a small TCP proxy this file runs, which is how the faults are made: the
server stops and comes back (the proxy closes its port, cutting uploads in flight), a slow link (the proxy throttles), a full
store (the proxy answers uploads with MinIO's 507 XMinioStorageFull), no permission (403 AccessDenied). Extraction runs as a
user runs it, `dflash_extract` in a process of its own; each case asserts the exit status, the message, and that the store
ends complete, checksummed, every sample exactly once."""
import json, os, shutil, signal, socket, subprocess, sys, threading, time
from pathlib import Path
import numpy as np, pytest, torch
from dflash.core import TRAIN_DATA
from dflash.shards import read_manifest
from dflash.extracted import ExtractedDataset
from dflash.store import Store

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
N = 40                                                   # samples: 11 MiB in bf16, shards of 0.5 to 1 MiB (batches of 512 tokens)
ARGS = dict(max_samples=N, shard_mb=0.5, token_budget=512, store_dtype='bf16')
FULL = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>XMinioStorageFull</Code><Message>Storage backend has reached its minimum free drive threshold. Please delete a few objects to proceed.</Message></Error>'
DENY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'


def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def _read_head(c):
    """The head of one HTTP request from socket `c`: (method, request line and headers without Connection and Expect, headers, body bytes
    read past them), or None at the end of the connection."""
    buf = b''
    while b'\r\n\r\n' not in buf:
        b = c.recv(65536)
        if not b: return None
        buf += b
    head, rest = buf.split(b'\r\n\r\n', 1)
    lines = head.split(b'\r\n')
    hdrs = {k.strip().lower(): v.strip() for k, v in (l.split(b':', 1) for l in lines[1:] if b':' in l)}
    keep = [l for l in lines[1:] if not l.lower().startswith((b'connection:', b'expect:'))]
    return lines[0].split(b' ')[0].decode(), [lines[0], *keep, b'Connection: close'], hdrs, rest


class Proxy:
    """A TCP proxy in front of the S3 server, one request at a time per connection: mode 'up' forwards, 'down' closes the port and
    cuts every connection (the server stopped), 'full' and 'deny' answer uploads (PUT, POST) with 507 and 403; `rate` (bytes/s)
    throttles both directions. It counts the uploads it forwarded."""
    def __init__(self, upstream):
        self.upstream, self.port, self.mode, self.rate, self.conns, self.lock = upstream, free_port(), 'up', None, set(), threading.Lock()
        self.puts = self.shard_puts = self.cut = 0        # uploads forwarded; shard uploads begun; uploads cut in flight
        self.uploading = set()
        self.listen()

    def listen(self):
        self.srv = socket.socket(); self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(('127.0.0.1', self.port)); self.srv.listen(64)
        threading.Thread(target=self._accept, args=(self.srv,), daemon=True).start()

    def set(self, mode, rate=None):
        was, self.mode, self.rate = self.mode, mode, rate
        if mode == 'down' and was != 'down':
            self.srv.close()
            with self.lock:
                self.cut += len(self.uploading)
                for c in list(self.conns): c.close()
        if mode != 'down' and was == 'down': self.listen()

    def _accept(self, srv):
        while True:
            try: c, _ = srv.accept()
            except OSError: return
            with self.lock: self.conns.add(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _send(self, c, data):
        for i in range(0, len(data), 16384):
            if self.mode == 'down': raise OSError('cut')
            c.sendall(data[i:i + 16384])
            if self.rate: time.sleep(16384 / self.rate)

    def _serve(self, c):
        try:
            while (req := _read_head(c)) is not None:
                method, lines, hdrs, body = req
                if self.mode == 'down': return
                if method in ('PUT', 'POST') and self.mode in ('full', 'deny'):   # refused before its body, as a server does
                    code, xml = (b'507 Insufficient Storage', FULL) if self.mode == 'full' else (b'403 Forbidden', DENY)
                    c.sendall(b'HTTP/1.1 ' + code + b'\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: '
                              + str(len(xml)).encode() + b'\r\n\r\n' + xml)
                    return
                if hdrs.get(b'expect', b'').lower() == b'100-continue': c.sendall(b'HTTP/1.1 100 Continue\r\n\r\n')
                n = int(hdrs.get(b'content-length', b'0'))
                if method == 'PUT' and b'shard-' in lines[0]: self.shard_puts += 1
                with self.lock: self.uploading.add(c)
                while len(body) < n:                                     # the upload's bytes at the link's rate; cut when the server stops
                    b = c.recv(min(16384, n - len(body)))
                    if not b or self.mode == 'down': return
                    body += b
                    if self.rate: time.sleep(len(b) / self.rate)
                with self.lock: self.uploading.discard(c)
                with socket.create_connection(('127.0.0.1', self.upstream)) as u:
                    u.sendall(b'\r\n'.join(lines) + b'\r\n\r\n' + body)
                    resp = b''
                    while b := u.recv(65536): resp += b
                if method == 'PUT': self.puts += 1
                self._send(c, resp)
                return                                                   # Connection: close, as the server said
        except OSError: pass
        finally:
            with self.lock: self.conns.discard(c); self.uploading.discard(c)
            c.close()


@pytest.fixture(scope='module')
def s3(tmp_path_factory):
    "moto's S3 server on a free port, a proxy in front of it, the bucket `dflash-test`; the environment a user's shell would have."
    d, port = tmp_path_factory.mktemp('s3'), free_port()
    srv = subprocess.Popen([BIN / 'moto_server', '-H', '127.0.0.1', '-p', str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try: socket.create_connection(('127.0.0.1', port), timeout=0.2).close(); break
        except OSError: time.sleep(0.1)
    proxy = Proxy(port)
    env = dict(os.environ, AWS_ACCESS_KEY_ID='testing', AWS_SECRET_ACCESS_KEY='testing', AWS_DEFAULT_REGION='us-east-1',
               AWS_ENDPOINT_URL=f'http://127.0.0.1:{proxy.port}', DFLASH_CACHE=str(d / 'cache'))
    old = {k: os.environ.get(k) for k in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_DEFAULT_REGION', 'AWS_ENDPOINT_URL', 'DFLASH_CACHE')}
    os.environ.update({k: env[k] for k in old})
    import fsspec
    fs = fsspec.filesystem('s3', skip_instance_cache=True, client_kwargs=dict(endpoint_url=f'http://127.0.0.1:{port}'))
    fs.mkdir('dflash-test')
    yield dict(env=env, proxy=proxy, fs=fs, d=d)
    for k, v in old.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v
    srv.terminate(); srv.wait(10)


def extract_cli(s3, url, *args, staging=None, timeout=300, progress=False):
    "`dflash_extract` into `url` in a process of its own: (exit status, summary or None, stderr)."
    cmd = [BIN / 'dflash_extract', '--out', url, *[x for k, v in ARGS.items() for x in ('--' + k.replace('_', '-'), v)], '--store-retries', 3,
           '--staging-dir', staging or s3['d'] / ('stage-' + url.rsplit('/', 1)[-1]), *([] if progress else ['--no-progress']), *args]
    r = subprocess.run([str(a) for a in cmd], env=s3['env'], capture_output=True, text=True, timeout=timeout)
    summary = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    return r.returncode, summary, r.stderr


def whole(url, local):
    "The store's extraction is complete, each sample once, each shard's bytes as recorded, and sample for sample the local one."
    xs, xl = ExtractedDataset(url, require_complete=True, cache_gb=1.0), ExtractedDataset(local)
    assert xs.verify_all() and list(xs.sample_ids) == list(range(N)) == list(xl.sample_ids)
    for i in range(N): assert xs[i]['hidden_states'].equal(xl[i]['hidden_states']) and xs[i]['input_ids'].equal(xl[i]['input_ids'])
    xs.close()
    return xs.manifest


@pytest.fixture(scope='module')
def local(s3):
    "The same extraction into a local folder: what every store extraction must equal."
    from dflash.extract import extract
    return extract(out=str(s3['d'] / 'local'), progress=False, **ARGS)['out']


def test_no_bucket_no_permission_unreachable(s3):
    "Each is one error naming the URL, before the target is loaded or anything is staged."
    code, _, err = extract_cli(s3, 's3://no-such-bucket/run')
    assert code == 1 and 's3://no-such-bucket/run: no such bucket' in err and 'Loading weights' not in err, err[-2000:]
    s3['proxy'].set('deny')
    try: code, _, err = extract_cli(s3, 's3://dflash-test/denied')
    finally: s3['proxy'].set('up')
    assert code == 1 and 's3://dflash-test/denied: no permission to write there' in err and 'Loading weights' not in err, err[-2000:]
    s3['proxy'].set('down')
    try: code, _, err = extract_cli(s3, 's3://dflash-test/away')
    finally: s3['proxy'].set('up')
    assert code == 1 and 's3://dflash-test/away' in err and 'unreachable' in err and 'Loading weights' not in err, err[-2000:]
    assert not (s3['d'] / 'stage-denied').exists() and not (s3['d'] / 'stage-away').exists()


def test_server_stops_mid_upload_and_comes_back(s3, local):
    "The server stops while a shard is on its way (a slow link keeps it there) and comes back in 3 s: the retries carry the run through."
    p = s3['proxy']; p.set('up', rate=2 << 20); began, cut = p.shard_puts, p.cut
    def outage():
        while p.shard_puts == began: time.sleep(0.01)   # a shard's upload has begun: its bytes are on the wire
        time.sleep(0.05); p.set('down'); time.sleep(3); p.set('up', rate=2 << 20)
    t = threading.Thread(target=outage, daemon=True); t.start()
    try: code, s, err = extract_cli(s3, 's3://dflash-test/outage')
    finally: t.join(30); p.set('up')
    assert p.cut > cut                                   # an upload was cut in flight
    assert code == 0 and s['complete'] and s['uploaded'] == len(read_manifest(local)['shards']), err[-3000:]
    whole('s3://dflash-test/outage', local)


def test_outage_past_the_retries_then_resume(s3, local):
    "A store away longer than the retries stop the run with its staged shards kept and how to go on; the same command then completes."
    p = s3['proxy']; began = p.shard_puts
    def outage():
        while p.shard_puts == began: time.sleep(0.01)
        p.set('down')
    t = threading.Thread(target=outage, daemon=True); t.start()
    try: code, _, err = extract_cli(s3, 's3://dflash-test/long', '--store-retries', '1')
    finally: t.join(30); p.set('up')
    assert code == 1 and 'uploading to s3://dflash-test/long stopped' in err and 'run the same command to resume' in err, err[-3000:]
    stage = s3['d'] / 'stage-long'
    staged = {q.name for q in stage.glob('shard-*.safetensors')}
    code, s, err = extract_cli(s3, 's3://dflash-test/long')
    assert code == 0 and s['complete'], err[-3000:]
    m = whole('s3://dflash-test/long', local)
    assert staged <= {x['file'] for x in m['shards']} and not list(stage.glob('shard-*'))     # what was staged went up, then was let go


def test_store_full_then_resume(s3, local):
    "A full store (MinIO's 507) is found by the probe before any work, naming it; once there is room, the same command completes."
    s3['proxy'].set('full')
    try: code, _, err = extract_cli(s3, 's3://dflash-test/full')
    finally: s3['proxy'].set('up')
    assert code == 1 and 's3://dflash-test/full: the store is full' in err and 'then run the same command' in err, err[-3000:]
    assert 'Loading weights' not in err
    code, s, err = extract_cli(s3, 's3://dflash-test/full')
    assert code == 0 and s['complete'], err[-3000:]
    whole('s3://dflash-test/full', local)


def test_store_full_mid_run_keeps_staged(s3, local):
    "The store fills up after the first shards: the error says so, the staged shards stay, and a resume uploads them first."
    p = s3['proxy']; began = p.shard_puts
    def fill():
        while p.shard_puts < began + 2: time.sleep(0.01)
        p.set('full')
    t = threading.Thread(target=fill, daemon=True); t.start()
    try: code, _, err = extract_cli(s3, 's3://dflash-test/fills')
    finally: t.join(30)
    assert code == 1 and 'the store is full' in err and 'are kept in' in err, err[-3000:]
    p.set('up')
    code, s, err = extract_cli(s3, 's3://dflash-test/fills')
    assert code == 0 and s['complete'] and s['skipped'] > 0, err[-3000:]
    whole('s3://dflash-test/fills', local)


def test_deleted_and_altered_shards(s3, local):
    "A shard deleted and one replaced in the store: training refuses, naming each; a resume names both and extracts their samples again."
    url = 's3://dflash-test/damaged'
    code, s, err = extract_cli(s3, url)
    assert code == 0 and s['complete'], err[-2000:]
    m, fs = Store(url).read_json('manifest.json'), s3['fs']
    gone, bad = sorted(x['file'] for x in m['shards'])[:2]
    fs.rm(f'dflash-test/damaged/{gone}')
    size = next(x['bytes'] for x in m['shards'] if x['file'] == bad)
    fs.pipe(f'dflash-test/damaged/{bad}', os.urandom(size))                   # the same size, other bytes: only the ETag tells
    xd = ExtractedDataset(url, verify=True)
    j = {x['file']: k for k, x in enumerate(xd.manifest['shards'])}
    with pytest.raises(ValueError, match=f'{url}/{gone}: missing from the store'): xd.check_shard(j[gone])
    with pytest.raises(ValueError, match=f'{url}/{bad}: altered in the store'): xd.check_shard(j[bad])
    code, s, err = extract_cli(s3, url)
    assert code == 0 and s['complete'] and f'{url}/{gone}: missing from the store' in err and f'{url}/{bad}: altered in the store' in err, err[-3000:]
    assert s['samples'] == sum(x['num_samples'] for x in m['shards'] if x['file'] in (gone, bad))
    whole(url, local)


def test_slow_store_staging_bounded(s3, local):
    "A slow store (1 MiB/s) and 2 MiB of staging: the extraction waits for its uploads instead of filling the disk; the line shows the queue."
    s3['proxy'].set('up', rate=1 << 20)
    try: code, s, err = extract_cli(s3, 's3://dflash-test/slow', '--staging-disk-gb', 2 / 1024, '--uploads', '1', progress=True)
    finally: s3['proxy'].set('up')
    assert code == 0 and s['complete'], err[-3000:]
    biggest = max(x['bytes'] for x in read_manifest(local)['shards'])
    assert s['staging_peak_bytes'] <= (2 << 20) + biggest, s                  # the bound, and one batch past shard_mb at most
    assert 'upload queue' in err
    whole('s3://dflash-test/slow', local)


def test_train_from_store_is_bit_identical(s3, local, tmp_path):
    "Training from the store reads the same samples in the same seeded order as from the folder: the same losses, bit for bit."
    code, s, err = extract_cli(s3, 's3://dflash-test/train')
    assert code == 0, err[-2000:]
    from dflash.train import train_cli
    args = ['--num-layers', 1, '--num-anchors', 8, '--token-budget', 512, '--max-steps', 4, '--log-every', 1, '--no-final-eval',
            '--no-progress', '--val-data', 'none', '--no-servable']
    runs = {}
    for name, src in (('local', local), ('store', 's3://dflash-test/train')):
        r = subprocess.run([str(a) for a in [BIN / 'dflash_train', '--extracted', src, '--out', tmp_path / name, '--cache-gb', 0.01, *args]],
                           env=s3['env'], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [l['loss'] for l in map(json.loads, open(tmp_path / name / 'metrics.jsonl')) if 'loss' in l]
    assert len(runs['local']) == 4 and runs['local'] == runs['store'], runs
    c = json.loads((tmp_path / 'store' / 'result.json').read_text())['store_cache']
    assert 0 < c['peak'] <= c['max_bytes'] == int(0.01 * 2**30) and c['downloaded'] > 0, c       # the cache within its bound


def test_killed_mid_upload_then_resume(s3, local):
    "SIGKILL while a shard is on its way: the resume uploads what was staged, extracts the rest, and the store holds each sample once."
    p = s3['proxy']; p.set('up', rate=2 << 20); began = p.shard_puts
    url, stage = 's3://dflash-test/killed', s3['d'] / 'stage-killed'
    cmd = [str(a) for a in [BIN / 'dflash_extract', '--out', url, *[x for k, v in ARGS.items() for x in ('--' + k.replace('_', '-'), v)],
                            '--staging-dir', stage, '--no-progress']]
    proc = subprocess.Popen(cmd, env=s3['env'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while p.shard_puts < began + 2 and time.time() < deadline: time.sleep(0.01)
        proc.send_signal(signal.SIGKILL); proc.wait(30)
    finally: p.set('up')
    assert proc.returncode == -signal.SIGKILL
    code, s, err = extract_cli(s3, url)
    assert code == 0 and s['complete'], err[-3000:]
    whole(url, local)


def test_no_credentials_are_named_at_once(s3, tmp_path):
    "Issue 59, 12: missing credentials were retried as a network fault (minutes), and the hint named the endpoint, not the credentials."
    none = tmp_path / 'none'
    env = {k: v for k, v in s3['env'].items() if k not in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_PROFILE', 'AWS_SESSION_TOKEN')}
    env.update(AWS_EC2_METADATA_DISABLED='true', AWS_SHARED_CREDENTIALS_FILE=str(none), AWS_CONFIG_FILE=str(none))
    t0 = time.time()
    r = subprocess.run([str(a) for a in [BIN / 'dflash_extract', '--out', 's3://dflash-test/nocreds', '--staging-dir', tmp_path / 'st', '--no-progress']],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 's3://dflash-test/nocreds: no credentials for the store' in r.stderr and 'AWS_ACCESS_KEY_ID' in r.stderr, r.stderr[-2000:]
    assert 'unreachable' not in r.stderr and time.time() - t0 < 60 and not (tmp_path / 'st').exists()
