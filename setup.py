"""The package list, found rather than written: every package under fastppo/, and the device code
of kernels/ installed as fastppo.kernels. Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["fastppo", "fastppo.*"]) + ["fastppo.kernels"],
    package_dir={"fastppo.kernels": "kernels"},
)
