"""The package list for setuptools (everything else is in pyproject.toml).

pyproject.toml maps the folders core/, engines/, transports/ and migrations/ onto
``sessiontape.core`` ... ``sessiontape.migrations`` ([tool.setuptools.package-dir]);
setuptools' ``packages.find`` cannot prefix what it finds, so the list is made here:
every folder below those four (namespace folders included, as before), under
``sessiontape.``, so a new subpackage ships without an edit.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).resolve().parent

FOLDERS = ("core", "engines", "transports", "migrations")

packages = ["sessiontape"]
for folder in FOLDERS:
    found = find_namespace_packages(where=str(HERE / folder), exclude=["*__pycache__*"])
    packages += [f"sessiontape.{folder}", *(f"sessiontape.{folder}.{p}" for p in found)]

setup(packages=packages)
