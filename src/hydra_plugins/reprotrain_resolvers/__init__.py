"""Hydra imports every module under `hydra_plugins` when it starts, DVC's composition
(`dvc exp run`) included: this registers reprotrain's OmegaConf resolvers there."""

from reprotrain.project import register_resolvers

register_resolvers()
