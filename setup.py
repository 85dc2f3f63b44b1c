# Standard nbdev 2.4 setup.py: everything is read from settings.ini.
from configparser import ConfigParser
import setuptools, shlex

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

expected = 'version description keywords author author_email'.split()
missing = [o for o in expected if o not in cfg]
if missing: raise ValueError(f"settings.ini is missing: {missing}")

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['0 - Pre-Planning', '1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable']
lic = licenses[cfg['license'].lower()]
min_python = cfg['min_python']
requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
track_requirements = shlex.split(cfg.get('track_requirements', ''))
store_requirements = shlex.split(cfg.get('store_requirements', ''))
console_scripts = cfg.get('console_scripts', '').split()

setuptools.setup(
    name=cfg['lib_name'], version=cfg['version'], license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1], 'Natural Language :: ' + cfg['language'].title(),
                 'Programming Language :: Python :: 3'],
    description=cfg['description'], author=cfg['author'], author_email=cfg['author_email'],
    keywords=cfg['keywords'], url=cfg['git_url'],
    packages=setuptools.find_packages(include=['dflash', 'dflash.*']),
    include_package_data=True, install_requires=requirements,
    extras_require={'dev': dev_requirements, 'track': track_requirements, 'store': store_requirements}, python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(), long_description_content_type='text/markdown',
    zip_safe=False, entry_points={'console_scripts': console_scripts, 'nbdev': [f'{cfg["lib_name"]}={cfg["lib_name"]}._modidx:d']})
