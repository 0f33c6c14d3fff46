"""Hydra YAML configs, shipped as the package `scaletrain.configs` (see setup.py) so installed copies find them."""
