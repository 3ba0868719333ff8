"""Experiments: the config schema, loading an experiment file with overrides, and validation."""

from zaya_jax.experiment.load import config_from_file, load_experiment
from zaya_jax.experiment.schema import base_config
from zaya_jax.parallel.axes import MESH_AXES
from zaya_jax.experiment.validate import Experiment

__all__ = ["Experiment", "MESH_AXES", "base_config", "config_from_file", "load_experiment"]
